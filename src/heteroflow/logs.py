"""How every HeteroFlow process logs (P3): text or JSON lines, secrets redacted, and the
id of the request a line was written for.

* ``REQUEST_ID``: a context variable holding the id of the request being answered. The
  management API's middleware (``api/observe.py``) and the gateway's ``/v1`` handling
  (``gateway/app.py``) set it for the length of one request, so every line logged while
  answering it carries the id; the gateway sends the same id to the engine
  (``x-request-id``), so a client's, the gateway's and the engine's lines can be matched.
* ``RedactSecrets``: a filter on the process's handler that rewrites each record's
  message (arguments merged in) and traceback before any formatter sees them:
  OpenAI-style API keys (``sk-…``), ``Bearer``/``Basic`` credentials, ``key=value`` and
  ``"key": "value"`` pairs whose key names a password, secret, token or API key, the
  password of a URL (``postgresql://user:…@host``), and the process's own secrets
  (node token, gateway token — ``register_secrets``) wherever they appear.
* ``JsonFormatter``: one JSON object per line — ``time`` (UTC, ISO 8601, ms), ``level``,
  ``logger``, ``message``, ``request_id`` inside a request, ``exception`` with a
  traceback. Nothing else of the record is written (an ``extra`` could hold anything).
* ``configure``: the root handler on stderr, ``HETEROFLOW_LOG_FORMAT`` = ``text`` (the
  default, as before) or ``json``; redaction applies to both. ``to_file``: the lines to a
  file as well, the terminal keeping warnings and errors (``up``'s own progress lines
  are its terminal output).

No I/O beyond the handlers' streams; the gateway and the agent import it as the server
does (it sits outside the layers, like ``serving``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_REQUEST_ID_CHARS = 128
REDACTED = "***"
# A registered secret shorter than this is not searched for: it would blank out
# ordinary words (a node token of "dev" would redact every "dev" in every line).
MIN_SECRET_CHARS = 6

REQUEST_ID: ContextVar[str | None] = ContextVar("heteroflow_request_id", default=None)


def new_request_id() -> str:
    return "req_" + os.urandom(16).hex()


def request_id(sent: bytes | None) -> str:
    """The caller's ``x-request-id`` when usable, else a new one."""
    # printable ASCII only: it is echoed in a header and written to logs
    if sent and len(sent) <= MAX_REQUEST_ID_CHARS and all(0x20 <= c < 0x7F for c in sent):
        return sent.decode("ascii")
    return new_request_id()


# --- redaction -------------------------------------------------------------------------
# a name that says its value is a secret: password, node_token, x-api-key, jwt_secret...
_SENSITIVE = r"(?:[A-Za-z0-9]+[_-])*(?:password|passwd|secret|token|api[_-]?key)(?:[_-]?key)?"
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # the password of a URL: scheme://user:password@host
    (re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]+):[^\s@/]+@"), rf"\1:{REDACTED}@"),
    # HTTP credentials: Authorization: Bearer <token> / Basic <base64>
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), rf"\1 {REDACTED}"),
    # OpenAI-style keys (HeteroFlow's: sk-<uuid>); a display prefix (sk-1a2b…) stays
    (re.compile(r"\bsk-[A-Za-z0-9][A-Za-z0-9_-]{7,}"), f"sk-{REDACTED}"),
    # "password": "…", token='…' (a quoted value, spaces and all)
    (
        re.compile(rf"(?i)\b({_SENSITIVE})\b([\"']?\s*[:=]\s*)([\"'])(?:(?!\3).)*\3"),
        rf"\1\2\3{REDACTED}\3",
    ),
    # password=…, node_token: …, HETEROFLOW_GATEWAY_TOKEN=… (an unquoted value)
    (
        re.compile(rf"(?i)\b({_SENSITIVE})\b([\"']?\s*[:=]\s*)(?![\"'\s])[^\s,;&}})\]]+"),
        rf"\1\2{REDACTED}",
    ),
)
_known: set[str] = set()
_known_pattern: re.Pattern[str] | None = None


def register_secrets(*values: str) -> None:
    """Secrets this process holds (node token, gateway token...): never written to a log,
    wherever they appear in a line."""
    global _known_pattern
    new = {v for v in values if len(v) >= MIN_SECRET_CHARS} - _known
    if not new:
        return
    _known.update(new)
    # longest first: a secret containing another is replaced whole
    alternatives = sorted(_known, key=len, reverse=True)
    _known_pattern = re.compile("|".join(re.escape(v) for v in alternatives))


def redact(text: str) -> str:
    """``text`` with every secret it contains replaced by ``***``."""
    if _known_pattern is not None:
        text = _known_pattern.sub(REDACTED, text)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactSecrets(logging.Filter):
    """Rewrites a record's message and traceback with ``redact`` (never drops it).

    The message is merged with its arguments first (``record.args`` then cleared), so a
    secret passed as an argument is caught as well as one in the format string."""

    _tracebacks = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it itself, unchanged
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._tracebacks.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class RequestIdFilter(logging.Filter):
    """Puts the request being answered (``REQUEST_ID``) on the record as ``request_id``.

    A handler's filters run in the thread and context that logged, so this reads the id
    of the request that wrote the line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.__dict__["request_id"] = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message[, request_id][, exception]."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def make_handler(fmt: LogFormat = "text", stream: IO[str] | None = None) -> logging.Handler:
    """A stream handler (stderr by default) writing ``fmt``, redacting, with request ids."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactSecrets())
    return handler


def to_file(path: Path, terminal_level: int = logging.WARNING) -> Path:
    """Log lines go to ``path`` (appended, owner-only, in the process's format, redacted)
    and the terminal keeps ``terminal_level`` and above: ``up`` prints its own progress
    lines there, and INFO lines between them read as noise (issue 33). A verbose process
    (root at DEBUG) keeps everything on the terminal too."""
    root = logging.getLogger()
    fmt: LogFormat = "text"
    for h in root.handlers:
        if isinstance(h.formatter, JsonFormatter):
            fmt = "json"
        if root.level > logging.DEBUG:
            h.setLevel(max(h.level, terminal_level))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    root.addHandler(make_handler(fmt, os.fdopen(fd, "a", buffering=1, encoding="utf-8")))
    return path


def configure(level: int, fmt: LogFormat = "text") -> None:
    """The process's logging: one root handler as ``make_handler`` builds it (nothing
    changes when the root already has one, as with ``logging.basicConfig``)."""
    logging.basicConfig(level=level, handlers=[make_handler(fmt)])
