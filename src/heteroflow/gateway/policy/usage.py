"""Token usage (M7, N4): found in answers by bytes, counted in memory, written in batches.

The hot path pays a dict update per request. ``usage_from_json`` finds a non-stream
answer's ``usage`` object without parsing the whole body (an embeddings answer can be
megabytes); ``UsageTracker`` does that for one answer, or watches an SSE stream for the
usage event by bytes, parses only that event, and drops it when the gateway asked for it
on the client's behalf.

``UsageCollector`` sums requests and tokens per (endpoint, tenant, model) and hands the
sums to a ``UsageSink`` every ``interval_s`` or once ``max_records`` requests were
counted. A failed write puts the sums back (nothing is lost while the server is away;
memory stays bounded by the number of keys times models, not by traffic); ``close()`` writes
what is left at shutdown. Sinks: the database (``services.usage.DbUsageSink``, in the
server), the server's API (``HttpUsageSink``, a separate gateway) or a JSON-lines file
(``JsonLinesUsageSink``, a standalone gateway).

The same flush carries each group's last request time (F4, the idle timer's input):
``touch`` keeps one time per group, so a flush writes at most one row per group however
busy it was. A sink that also has ``write_activity`` (``ActivitySink``: the database and
the server's API) gets them; a group that was quiet for a whole flush interval and gets
a request flushes at once, so the server learns of the first request after a quiet spell
within milliseconds, not seconds — the idle timer cannot put a service to sleep under a
request it has not heard of yet.

Every flush also carries the gateway's load (issue 14: the autoscaler's figures and the
drains of a scale-in or a rolling update) when the sink takes it (``ReportSink``: the
database and the server's API) and the gateway gave a ``load_source``: per backend of
its routing snapshot, the requests in flight, whether it drains, the engine's queue and
KV use, and the tokens/s it answered — counted here per backend (``backend_tokens``)
and averaged over the last ``TOKEN_WINDOW_S``. The load is sent every flush whether or
not anything happened (it is a state, not a sum: the server keeps each gateway's latest
report and ignores reports older than ``gateway_load_stale_s``); a failed write is not
retried, the next flush carries a newer one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import aiohttp
import orjson

from heteroflow.core.clock import Clock
from heteroflow.gateway.policy.answers import AnswerStats
from heteroflow.gateway.shaping.normalize import (
    Asked,
    StreamFix,
    fix_answer,
    needs_parse,
    rename_model,
)
from heteroflow.gateway.wire.errors import OpenAIError
from heteroflow.schemas.routing import activity_to_wire
from heteroflow.schemas.usage import GatewayLoad, UsageRow, activity_report_to_wire

logger = logging.getLogger(__name__)

USAGE_PATH = "/api/v1/gateway/usage"
ACTIVITY_PATH = "/api/v1/gateway/activity"
_USAGE_KEY = b'"usage":'
# An object follows the key (the usage event), not ``null`` (vLLM repeats "usage":null in
# every chunk once include_usage is on). Compact JSON (pydantic, orjson, nlohmann) and
# Python's json.dumps spacing.
_USAGE_OBJ = b'"usage":{'
_USAGE_OBJ_SPACED = b'"usage": {'
_ERROR_KEY = b'"error":'  # an error event mid-stream (vLLM, SGLang)
_CLOSE_ATTEMPTS = 3
_CLOSE_RETRY_S = 1.0
# tokens/s per backend are averaged over this long (issue 14: the autoscaler's
# tokens_per_s; it decides every 30 s by default)
TOKEN_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


class UsageSink(Protocol):
    async def write(self, rows: Sequence[UsageRow]) -> None:
        """Store every row, or raise: the collector keeps the rows and retries."""
        ...


@runtime_checkable
class ActivitySink(Protocol):
    async def write_activity(self, activity: dict[str, datetime]) -> None:
        """Store each group's last request time (group id -> time), or raise: the
        collector keeps them and retries."""
        ...


@runtime_checkable
class ReportSink(Protocol):
    async def write_report(self, activity: dict[str, datetime], load: GatewayLoad) -> None:
        """Store the groups' last request times (as ``write_activity``) and the
        gateway's load in one go, or raise: the times are kept and retried, the load is
        not (the next flush has a newer one)."""
        ...


# --- finding usage in answers -------------------------------------------------------


def usage_from_json(data: bytes) -> Usage | None:
    """The top-level ``usage`` of a JSON answer, parsing only that object.

    ``"usage":`` cannot occur inside a JSON string (its quotes would be escaped), and
    engines put the answer's usage after its choices, so the last occurrence is the one.
    """
    i = data.rfind(_USAGE_KEY)
    if i < 0:
        return None
    start = i + len(_USAGE_KEY)
    while start < len(data) and data[start] in b" \t\r\n":
        start += 1
    if start >= len(data) or data[start] != ord("{"):
        return None
    end = _object_end(data, start)
    if end < 0:
        return None
    try:
        obj = orjson.loads(data[start:end])
    except orjson.JSONDecodeError:
        return None
    return _usage(obj)


def _object_end(data: bytes, start: int) -> int:
    """Index after the ``}`` closing the object at ``start`` (usage holds no strings)."""
    depth, pos = 1, start + 1
    while depth:
        close = data.find(b"}", pos)
        if close < 0:
            return -1
        nested = data.find(b"{", pos, close)
        if nested >= 0:
            depth, pos = depth + 1, nested + 1
        else:
            depth, pos = depth - 1, close + 1
    return pos


def _usage(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    prompt = obj.get("prompt_tokens", 0)
    completion = obj.get("completion_tokens", 0)  # embeddings have none
    if not (_count(prompt) and _count(completion)):
        return None
    return Usage(prompt, completion)


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


class UsageTracker:
    """The token usage of one answer: ``usage`` once found (None while unknown), and the
    answer normalised to OpenAI's shape on the way (``normalize``, issue 15) — one parse
    serves both.

    A JSON answer is handed over whole (``answer``). A stream goes through ``feed``,
    which returns the bytes to send now: every complete event received so far (a partial
    event waits for its end, which costs the client nothing: it cannot use half an
    event). Only an event that contains a usage object (or needs a fix: an error event,
    a completions event with echo or logprobs) is parsed. With ``hide`` the usage-only
    event (``"choices": []``) is dropped: the client did not ask for it, so it must not
    see it (the gateway forced ``stream_options.include_usage`` upstream).
    ``asked`` (None: relay untouched) is what the request asked that shapes the answer.
    """

    __slots__ = ("_asked", "_fix", "_rest", "hide", "usage")

    def __init__(self, *, hide: bool, asked: Asked | None = None) -> None:
        self.hide = hide
        self.usage: Usage | None = None
        self._rest = b""
        self._asked = asked
        self._fix = StreamFix(asked, hide) if asked is not None and asked.stream else None

    def read_body(self, data: bytes) -> None:
        self.usage = usage_from_json(data)

    def answer(self, data: bytes) -> bytes | OpenAIError:
        """A whole 2xx JSON answer as the client is to get it (re-serialised only when a
        fix changed it), or the error to answer instead; its usage noted."""
        a = self._asked
        if a is None:
            self.usage = usage_from_json(data)
            return data
        if not needs_parse(a, data):
            self.usage = usage_from_json(data)
            # issue 26: the model as called (an embeddings answer's one key is found
            # without scanning its vectors)
            return rename_model(data, a.model_json, one=a.kind == "embeddings")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):  # not an answer object: relayed as it came
            self.usage = usage_from_json(data)
            return data
        self.usage = _usage(obj.get("usage"))
        fixed = fix_answer(a, obj)
        if isinstance(fixed, OpenAIError):
            return fixed
        return orjson.dumps(obj) if fixed else data

    def assembled(self, obj: dict[str, Any]) -> bytes | OpenAIError:
        """A non-stream answer assembled from a stream (``assemble``) as ``answer`` would
        give it, without a parse: fixed in place, serialised once; its usage noted."""
        self.usage = _usage(obj.get("usage"))
        if self._asked is not None:
            fixed = fix_answer(self._asked, obj)
            if isinstance(fixed, OpenAIError):
                return fixed
        return orjson.dumps(obj)

    def feed(self, chunk: bytes) -> bytes:
        if self._rest:
            chunk = self._rest + chunk
            self._rest = b""
        if chunk.endswith(b"\n\n"):  # the usual case: whole events
            out = chunk
        else:
            end = _last_event_end(chunk)
            if end < 0:
                self._rest = chunk
                return b""
            out, self._rest = chunk[:end], chunk[end:]
        return self._events(out)

    def finish(self) -> bytes:
        """What is left at the end of the stream (an event without its blank line)."""
        rest, self._rest = self._rest, b""
        return self._events(rest) if rest else rest

    def _events(self, out: bytes) -> bytes:
        fix = self._fix
        if fix is not None:
            out = fix.raw(out)
            if fix.per_event or _ERROR_KEY in out:
                return self._scan(out)
        if _USAGE_OBJ in out or _USAGE_OBJ_SPACED in out:
            return self._scan(out)
        return out

    def _scan(self, part: bytes) -> bytes:
        sep = b"\r\n\r\n" if b"\r\n\r\n" in part else b"\n\n"
        events = part.split(sep)
        out: list[bytes] = []
        changed = False
        for event in events:
            sent = self._event(event)
            if sent is None:
                out.append(event)
            else:
                out += sent
                changed = True
        return sep.join(out) if changed else part

    def _event(self, event: bytes) -> list[bytes] | None:
        """Record the event's usage; the events to send instead of it (None: itself)."""
        fix = self._fix
        if not (
            _USAGE_OBJ in event
            or _USAGE_OBJ_SPACED in event
            or (fix is not None and (fix.per_event or _ERROR_KEY in event))
        ):
            return None
        data = b"\n".join(
            line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]":
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        usage = _usage(obj.get("usage"))
        if usage is not None:
            self.usage = usage
            if self.hide and obj.get("choices") == []:
                return []
        fixed = None if fix is None else fix.event(obj)
        if fixed is None:
            return None
        return [b"data: " + orjson.dumps(o) for o in fixed]


def _last_event_end(chunk: bytes) -> int:
    lf = chunk.rfind(b"\n\n")
    crlf = chunk.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


# --- counting and flushing -----------------------------------------------------------


class _Sum:
    __slots__ = ("completion", "first_at", "prompt", "requests")

    def __init__(self, first_at: datetime) -> None:
        self.first_at = first_at
        self.requests = 0
        self.prompt = 0
        self.completion = 0


class UsageCollector:
    def __init__(
        self,
        sink: UsageSink,
        clock: Clock,
        *,
        interval_s: float = 5.0,
        max_records: int = 10_000,
        activity_sink: ActivitySink | None = None,
    ) -> None:
        self._sink = sink
        # F4: where the groups' last request times go; the usage sink when it takes them
        self._activity_sink = activity_sink or (sink if isinstance(sink, ActivitySink) else None)
        self._clock = clock
        self._interval = interval_s
        self._max = max_records
        self._sums: dict[tuple[str, str, str], _Sum] = {}
        self._counted = 0  # requests since the last flush started
        self._full = asyncio.Event()
        self._lock = asyncio.Lock()
        self._failing = False
        self._activity: dict[str, datetime] = {}  # group id -> last request, not yet written
        self._recent: set[str] = set()  # groups written by the last flush
        # --- issue 14: the gateway's load, sent with the activity ---
        self._load_source: Callable[[], GatewayLoad] | None = None
        self._tokens: dict[str, int] = {}  # task id -> tokens answered since the last roll
        # task id -> (monotonic time of a roll, tokens counted in the interval before it)
        self._token_window: dict[str, deque[tuple[float, int]]] = {}
        self._rates: dict[str, float] = {}  # task id -> tokens/s, as of the last roll
        self._started = clock.monotonic()
        self._load_failing = False
        # issue 33: answers, errors and latency per backend (the live series)
        self.answers = AnswerStats()

    # --- issue 14: load (in flight, tokens/s per backend) ---

    def set_load_source(self, source: Callable[[], GatewayLoad] | None) -> None:
        """What the gateway's load is, asked at every flush (the ``GatewayApp``)."""
        self._load_source = source

    def backend_tokens(self, task_id: str, tokens: int) -> None:
        """A backend (task) answered a request with ``tokens`` (prompt + completion)."""
        if task_id and tokens > 0:
            self._tokens[task_id] = self._tokens.get(task_id, 0) + tokens

    @property
    def token_rates(self) -> Mapping[str, float]:
        """Tokens/s per backend over the last ``TOKEN_WINDOW_S``, as of the last flush."""
        return self._rates

    def roll_tokens(self) -> dict[str, float]:
        """Close the current interval: tokens/s per backend over the window up to now."""
        now = self._clock.monotonic()
        counted, self._tokens = self._tokens, {}
        for task_id, n in counted.items():
            self._token_window.setdefault(task_id, deque()).append((now, n))
        span = max(min(TOKEN_WINDOW_S, now - self._started), 1e-3)
        rates: dict[str, float] = {}
        for task_id in list(self._token_window):
            window = self._token_window[task_id]
            while window and window[0][0] <= now - TOKEN_WINDOW_S:
                window.popleft()
            if not window:
                del self._token_window[task_id]
                continue
            rates[task_id] = sum(n for _, n in window) / span
        self._rates = rates
        self.answers.roll(now)
        return rates

    # --- end issue 14 (load) ---

    @property
    def sink(self) -> UsageSink:
        return self._sink

    @property
    def pending_activity(self) -> dict[str, datetime]:
        """Groups' last request times counted and not yet written."""
        return dict(self._activity)

    def touch(self, group_id: str) -> None:
        """A request was routed to a backend of ``group_id`` now (F4)."""
        if self._activity_sink is None:
            return
        if group_id not in self._activity and group_id not in self._recent:
            self._full.set()  # quiet until now: tell the server at once
        self._activity[group_id] = self._clock.now()

    @property
    def pending_requests(self) -> int:
        """Requests counted and not yet written."""
        return sum(s.requests for s in self._sums.values())

    def record(self, endpoint_id: str, tenant_id: str, model: str, usage: Usage | None) -> None:
        """Count one answered request (usage None: its tokens are unknown)."""
        key = (endpoint_id, tenant_id, model)
        s = self._sums.get(key)
        if s is None:
            s = self._sums[key] = _Sum(self._clock.now())
        s.requests += 1
        if usage is not None:
            s.prompt += usage.prompt_tokens
            s.completion += usage.completion_tokens
        self._counted += 1
        if self._counted >= self._max:
            self._full.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every ``interval_s`` or when ``max_records`` were counted, until stop.

        The last flush is ``close()``'s, after the server stopped taking requests.
        """
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while True:
                full = asyncio.ensure_future(self._full.wait())
                await asyncio.wait(
                    {stopping, full}, timeout=self._interval, return_when=asyncio.FIRST_COMPLETED
                )
                full.cancel()
                if stopping.done():
                    return
                await self.flush()
        finally:
            stopping.cancel()

    async def flush(self) -> bool:
        """Write what was counted; False when a sink failed (what it had is kept)."""
        async with self._lock:
            self._full.clear()
            self._counted = 0
            activity_ok = await self._flush_activity()
            if not self._sums:
                return activity_ok
            batch, self._sums = self._sums, {}
            rows = [
                UsageRow(e, t, m, s.requests, s.prompt, s.completion, s.first_at)
                for (e, t, m), s in batch.items()
            ]
            try:
                await self._sink.write(rows)
            except Exception as exc:  # any sink failure: keep the sums, retry later
                self._merge_back(batch)
                if not self._failing:
                    logger.warning(
                        "usage: writing %d rows failed (%s); keeping them for the next flush",
                        len(rows),
                        type(exc).__name__,
                    )
                self._failing = True
                return False
            if self._failing:
                logger.info("usage: writing works again")
                self._failing = False
            return activity_ok

    async def _flush_activity(self) -> bool:
        sink = self._activity_sink
        # issue 14: the load goes with the activity, every flush, to a sink that takes it
        load: GatewayLoad | None = None
        if self._load_source is not None and isinstance(sink, ReportSink):
            self.roll_tokens()
            try:
                load = self._load_source()
            except Exception:  # a bug there must not stop the activity (F4)
                logger.exception("load: building the gateway's load report failed")
        if sink is None or (not self._activity and load is None):
            self._recent = set()
            return True
        batch, self._activity = self._activity, {}
        try:
            if load is not None and isinstance(sink, ReportSink):
                await sink.write_report(batch, load)
            else:
                await sink.write_activity(batch)
        except Exception as exc:  # keep the times (the newer one wins), retry later
            for gid, at in batch.items():
                newer = self._activity.get(gid)
                if newer is None or newer < at:
                    self._activity[gid] = at
            if batch or not self._load_failing:
                logger.warning(
                    "activity: writing %d groups' last request times%s failed (%s); "
                    "kept for the next flush",
                    len(batch),
                    " and the gateway's load" if load is not None else "",
                    type(exc).__name__,
                )
            self._load_failing = load is not None
            return False
        if self._load_failing:
            logger.info("activity: writing the gateway's load works again")
            self._load_failing = False
        self._recent = set(batch)
        return True

    async def close(self) -> None:
        """Final flush at shutdown, retried a few times; what still fails is logged."""
        for attempt in range(_CLOSE_ATTEMPTS):
            if await self.flush():
                return
            if attempt + 1 < _CLOSE_ATTEMPTS:
                await asyncio.sleep(_CLOSE_RETRY_S)
        logger.error(
            "usage: %d requests could not be written at shutdown and are lost",
            self.pending_requests,
        )

    def _merge_back(self, batch: dict[tuple[str, str, str], _Sum]) -> None:
        for key, old in batch.items():
            s = self._sums.get(key)
            if s is None:
                self._sums[key] = old
                continue
            s.first_at = min(s.first_at, old.first_at)
            s.requests += old.requests
            s.prompt += old.prompt
            s.completion += old.completion


# --- sinks of a gateway without a database -------------------------------------------


class UsageSinkError(Exception):
    """A write failed; the message is safe to log (no token)."""


class HttpUsageSink:
    """A separate gateway hands its batches to the server (gateway token auth).

    One short-lived session per flush: a request every few seconds needs no pool.
    """

    def __init__(self, server_url: str, token: str, *, timeout_s: float = 10.0) -> None:
        self.server_url = server_url.rstrip("/")
        self.token = token  # also what a separate gateway's wakes present (gateway.routing.hold)
        self._url = self.server_url + USAGE_PATH
        self._activity_url = self.server_url + ACTIVITY_PATH
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def write(self, rows: Sequence[UsageRow]) -> None:
        await self._post(self._url, orjson.dumps({"records": [r.to_wire() for r in rows]}))

    async def write_activity(self, activity: dict[str, datetime]) -> None:
        """F4: the groups' last request times (``POST /api/v1/gateway/activity``)."""
        await self._post(self._activity_url, orjson.dumps(activity_to_wire(activity)))

    async def write_report(self, activity: dict[str, datetime], load: GatewayLoad) -> None:
        """F4 and issue 14: the times and the gateway's load, in one POST."""
        body = orjson.dumps(activity_report_to_wire(activity, load))
        await self._post(self._activity_url, body)

    async def _post(self, url: str, body: bytes) -> None:
        try:
            async with (
                aiohttp.ClientSession(timeout=self._timeout) as session,
                session.post(url, data=body, headers=self._headers) as resp,
            ):
                if resp.status >= 300:
                    raise UsageSinkError(f"HTTP {resp.status} from {url}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UsageSinkError(f"{type(exc).__name__} posting to {url}") from exc


class JsonLinesUsageSink:
    """A standalone gateway appends one JSON object per row to a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def write(self, rows: Sequence[UsageRow]) -> None:
        data = b"".join(orjson.dumps(r.to_wire()) + b"\n" for r in rows)
        await asyncio.to_thread(self._append, data)

    def _append(self, data: bytes) -> None:
        with self.path.open("ab") as f:
            f.write(data)

