"""Engine answers in OpenAI's published schema (issue 15, item 5; M13).

Pure functions, no I/O. The usage tracker (``usage.UsageTracker``, which parses an
answer at most once, and only when a cheap byte check says it may need a fix) calls
them. ``Asked`` is what the client asked that shapes the answer (built once per
request by ``asked``, which also refuses what cannot be honoured: ``echo`` with
``logprobs`` or token prompts); ``fix_answer`` adds what the schema requires and
engines leave out (chat ``logprobs`` and ``refusal``; ``cmpl-`` ids and the legacy
logprobs shape for completions; echo; ``dimensions`` checked, base64 embeddings), in
place on the parsed answer, and says whether it changed anything (the caller
re-serialises only then); ``StreamFix`` does the same per SSE event of a stream (usage
in a chunk of its own, or none when the client did not ask; error events in OpenAI's
shape), keeping the little state it needs (echo, text offsets). Engine errors are
``engine_errors``'.

**The model as called (issue 26).** An engine names its model by its own id (a path, a
file name, another tenant's name for a shared service); every answer names it as the
caller called it (the route's public name, ``Asked.model``), on every route alike:
``_fix_head`` on a parsed answer, ``rename_model`` on bytes (an unparsed JSON answer,
each stream event) — no parse, and a copy only when the engine's name differs.
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson

from heteroflow.gateway.shaping.engine_errors import KINDS, Kind, engine_error
from heteroflow.gateway.wire.errors import OpenAIError

# --- what the client asked -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request asked that shapes its answer (one per request, built by ``asked``)."""

    kind: Kind
    stream: bool = False
    n: int = 1
    echo: tuple[str, ...] | None = None  # the prompts to put before their completions
    logprobs: bool = False  # completions: logprobs asked (converted to that API's shape)
    dimensions: int | None = None
    base64: bool = False
    created: int = 0  # what ``created`` is when an engine leaves it out (now)
    # the name the caller called the model by ("" = leave the engine's), and as JSON
    model: str = ""
    model_json: bytes = b""


def asked(path: str, body: dict[str, Any], now: int) -> Asked | OpenAIError:
    """``Asked`` for a request, or why it cannot be answered as asked.

    ``echo`` is done here, for every engine alike (the engine is asked without it): the
    prompt is put before the completion. With ``logprobs`` OpenAI also answers the
    prompt's tokens' logprobs, which engines do not all give: refused rather than
    answered without them (a scorer reading them would be silently wrong); so are token
    prompts, whose text the gateway does not know.
    """
    kind = KINDS[path]
    stream = body.get("stream") is True
    called = body.get("model")
    model = called if isinstance(called, str) else ""
    model_json = orjson.dumps(model) if model else b""
    n = body.get("n")
    n = n if type(n) is int and n > 0 else 1
    if kind == "embeddings":
        dims = body.get("dimensions")
        return Asked(
            kind,
            dimensions=dims if type(dims) is int else None,
            base64=body.get("encoding_format") == "base64",
            created=now,
            model=model,
            model_json=model_json,
        )
    logprobs = kind == "completions" and body.get("logprobs") not in (None, False)
    echo: tuple[str, ...] | None = None
    if kind == "completions" and body.get("echo") is True:
        if logprobs:
            return _refuse_echo("`echo` together with `logprobs` is not supported.")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            echo = (prompt,)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            echo = tuple(prompt)
        else:
            return _refuse_echo("`echo` is supported only with a text prompt (or a list of them).")
    return Asked(kind, stream, n, echo, logprobs, created=now, model=model, model_json=model_json)


def _refuse_echo(message: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", "echo", "unsupported_value")


# --- answers -------------------------------------------------------------------------


def needs_parse(a: Asked, data: bytes) -> bool:
    """Whether a 2xx JSON answer may need a fix (False: relay it untouched, unparsed).

    Key names cannot occur unescaped inside JSON strings, so counting them is exact: a
    chat answer needs nothing when every choice (``finish_reason``) has ``logprobs``
    and a ``refusal``. Completions are always parsed (llama.cpp's ids are chat ids);
    embeddings (megabytes) only when ``dimensions`` or base64 floats are to be checked.
    """
    if a.kind == "chat":
        choices = data.count(b'"finish_reason"')
        return data.count(b'"logprobs"') < choices or data.count(b'"refusal"') < choices
    if a.kind == "embeddings":
        return a.dimensions is not None or (a.base64 and b'"embedding":[' in data)
    return True


def fix_answer(a: Asked, obj: dict[str, Any]) -> bool | OpenAIError:
    """Fix a parsed 2xx (non-stream) answer in place; True when something changed, or the
    error to answer instead (``dimensions`` the model cannot give)."""
    if a.kind == "embeddings":
        return _fix_embeddings(a, obj)
    changed = _fix_head(obj, "chat.completion" if a.kind == "chat" else "text_completion", a)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return changed
    for choice in choices:
        if isinstance(choice, dict):
            if a.kind == "chat":
                changed |= _fix_chat_choice(choice)
            else:
                changed |= _fix_text_choice(choice, a, None)
    return changed


def _fix_head(obj: dict[str, Any], obj_type: str, a: Asked) -> bool:
    changed = _fix_model(obj, a)
    if obj.get("object") != obj_type:
        obj["object"] = obj_type
        changed = True
    created = obj.get("created")
    if type(created) is not int:
        obj["created"] = int(created) if isinstance(created, float) else a.created
        changed = True
    if a.kind == "completions":
        rid = obj.get("id")
        if not (isinstance(rid, str) and rid.startswith("cmpl-")):
            rid = rid if isinstance(rid, str) else ""
            obj["id"] = "cmpl-" + rid.removeprefix("chatcmpl-")
            changed = True
    return changed


def _fix_chat_choice(choice: dict[str, Any]) -> bool:
    changed = False
    if "logprobs" not in choice:
        choice["logprobs"] = None
        changed = True
    msg = choice.get("message")
    if isinstance(msg, dict):
        for key in ("content", "refusal"):
            if key not in msg:
                msg[key] = None
                changed = True
    return changed


def _fix_text_choice(choice: dict[str, Any], a: Asked, offsets: dict[int, int] | None) -> bool:
    """A completions choice: logprobs in that API's shape, the prompt first with echo.

    ``offsets`` (a stream) keeps each choice's text length so far, for ``text_offset``.
    """
    changed = False
    index = choice.get("index")
    index = index if type(index) is int else 0
    start = 0 if offsets is None else offsets.get(index, 0)
    text = choice.get("text")
    text = text if isinstance(text, str) else ""
    if a.echo is not None and start == 0:
        prompt = a.echo[min(index // a.n, len(a.echo) - 1)]
        text = choice["text"] = prompt + text
        changed = True
    if "logprobs" not in choice:
        choice["logprobs"] = None
        changed = True
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and "content" in lp and "tokens" not in lp:
        choice["logprobs"] = _completion_logprobs(lp.get("content"), start)
        changed = True
    if offsets is not None:
        offsets[index] = start + len(text)
    return changed


def _completion_logprobs(content: object, start: int) -> dict[str, list[Any]]:
    """Chat-shaped logprobs (``content: [{token, logprob, top_logprobs: [...]}]``) in the
    legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    token -> logprob map per token) and ``text_offset`` (where each token starts in the
    answer's text)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, Any] | None] = []
    offsets: list[int] = []
    pos = start
    for entry in content if isinstance(content, list) else ():
        if not isinstance(entry, dict):
            continue
        token = str(entry.get("token", ""))
        tokens.append(token)
        token_logprobs.append(entry.get("logprob"))
        alts = entry.get("top_logprobs")
        top.append(
            {str(t.get("token", "")): t.get("logprob") for t in alts if isinstance(t, dict)}
            if isinstance(alts, list)
            else None
        )
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _fix_model(obj: dict[str, Any], a: Asked) -> bool:
    if a.model and obj.get("model") != a.model:
        obj["model"] = a.model
        return True
    return False


def _fix_embeddings(a: Asked, obj: dict[str, Any]) -> bool | OpenAIError:
    changed = _fix_model(obj, a)
    if obj.get("object") != "list":
        obj["object"] = "list"
        changed = True
    data = obj.get("data")
    for i, item in enumerate(data if isinstance(data, list) else ()):
        if not isinstance(item, dict):
            continue
        if item.get("object") != "embedding":
            item["object"] = "embedding"
            changed = True
        if "index" not in item:
            item["index"] = i
            changed = True
        vec = item.get("embedding")
        size = len(vec) if isinstance(vec, list) else _base64_floats(vec)
        if a.dimensions is not None and size is not None and size != a.dimensions:
            return OpenAIError(
                400,
                f"This model's embeddings have {size} dimensions; it cannot answer "
                f"{a.dimensions}. Leave `dimensions` out or set it to {size}.",
                "invalid_request_error",
                "dimensions",
                "unsupported_value",
            )
        if a.base64 and isinstance(vec, list):
            item["embedding"] = _to_base64(vec)
            changed = True
    return changed


def _base64_floats(vec: object) -> int | None:
    if not isinstance(vec, str):
        return None
    try:
        return len(base64.b64decode(vec)) // 4
    except ValueError:
        return None


def _to_base64(vec: list[Any]) -> str:
    """OpenAI's base64 embedding: the float32 values, little-endian, base64-encoded."""
    floats = array("f", vec)
    if sys.byteorder == "big":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode("ascii")


_MODEL_KEY = b'"model":'
_BLANKS = b" \t\r\n"
# an embeddings answer's one ``model`` key: in its head (vLLM, llama.cpp) or, in
# OpenAI's order, after the vectors (found from the end): megabytes are never scanned
_HEAD = 1024


def rename_model(data: bytes, name: bytes, *, one: bool = False) -> bytes:
    """``data`` (JSON, or SSE events of JSON) with the string value of every ``"model"``
    key replaced by ``name`` (a JSON string; empty: ``data`` as it is); ``one``: only the
    top-level key of one JSON answer whose schema has no other (embeddings).

    A key cannot occur unescaped inside a JSON string, so a byte search finds keys only;
    nothing is parsed, and ``data`` is copied only when a value differs from ``name``.
    """
    if not name:
        return data
    if one:
        i = data.find(_MODEL_KEY, 0, _HEAD)
        return _rename_at(data, data.rfind(_MODEL_KEY) if i < 0 else i, name)
    i = data.find(_MODEL_KEY)
    if i < 0:
        return data
    view = memoryview(data)  # the answer is copied once, by the join
    parts: list[bytes | memoryview] = []
    start = 0
    while i >= 0:
        v, end = _value(data, i)
        if end >= 0 and view[v:end] != name:
            parts += (view[start:v], name)
            start = end
        i = data.find(_MODEL_KEY, max(v, end))
    if not parts:
        return data
    parts.append(view[start:])
    return b"".join(parts)


def _rename_at(data: bytes, i: int, name: bytes) -> bytes:
    if i < 0:
        return data
    v, end = _value(data, i)
    view = memoryview(data)
    if end < 0 or view[v:end] == name:
        return data
    return b"".join((view[:v], name, view[end:]))


def _value(data: bytes, key: int) -> tuple[int, int]:
    """Where the value of the ``"model":`` key at ``key`` starts and, when it is a
    string, ends (-1: not a string — null, an object — or unterminated)."""
    v, size = key + len(_MODEL_KEY), len(data)
    while v < size and data[v] in _BLANKS:
        v += 1
    if v >= size or data[v] != 0x22:
        return v, -1
    j = data.find(b'"', v + 1)
    while j >= 0:
        k = j
        while data[k - 1] == 0x5C:  # backslashes: the quote is escaped when they are odd
            k -= 1
        if (j - k) % 2 == 0:
            return v, j + 1
        j = data.find(b'"', j + 1)
    return v, -1


# --- streams -------------------------------------------------------------------------


@dataclass(slots=True)
class StreamFix:
    """The fixes of one stream's events, and the state they need.

    ``hide``: the client did not ask for usage (the gateway did, to count tokens): no
    event may carry it. Otherwise usage comes as OpenAI sends it: a last chunk of its
    own with ``choices: []`` (llama.cpp puts it in a completions stream's last choice
    chunk: split in two).
    """

    asked: Asked
    hide: bool
    _offsets: dict[int, int] = field(default_factory=dict)
    _seen: bytes = b""  # the engine's ``"model":"…"`` as it last came (each event repeats it)

    @property
    def per_event(self) -> bool:
        """Whether every event must be parsed (echo, completions logprobs)."""
        a = self.asked
        return a.kind == "completions" and (a.echo is not None or a.logprobs)

    def raw(self, out: bytes) -> bytes:
        """Byte-level fixes of whole events, no parsing: the model as called, completions
        ids, and the ``"usage":null`` vLLM puts in every chunk once usage is asked for."""
        out = self._rename(out)
        if self.asked.kind == "completions" and b'"chatcmpl-' in out:
            out = out.replace(b'"id":"chatcmpl-', b'"id":"cmpl-')
            out = out.replace(b'"id": "chatcmpl-', b'"id": "cmpl-')
        if self.hide and b'"usage":null' in out:
            out = out.replace(b',"usage":null', b"").replace(b'"usage":null,', b"")
        return out

    def _rename(self, out: bytes) -> bytes:
        """``rename_model`` for two byte counts while the events repeat the engine's
        ``"model":"…"`` as the first one spelt it (then one replace when it differs)."""
        name = self.asked.model_json
        keys = out.count(_MODEL_KEY) if name else 0
        if not keys:
            return out
        seen = self._seen
        if not seen or out.count(seen) != keys:  # the first event, or another spelling
            i = out.find(_MODEL_KEY)
            end = _value(out, i)[1]
            seen = self._seen = out[i:end] if end >= 0 else b""
            if not seen or out.count(seen) != keys:
                return rename_model(out, name)
        called = _MODEL_KEY + name
        return out if seen == called else out.replace(seen, called)

    def event(self, obj: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The events to send for one parsed event; None: send it unchanged."""
        changed = False
        a = self.asked
        if a.kind == "completions":
            changed = _fix_head(obj, "text_completion", a)
            choices = obj.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict):
                    changed |= _fix_text_choice(choice, a, self._offsets)
        if "error" in obj and "choices" not in obj:
            return [_stream_error(obj, a)]
        usage = obj.get("usage")
        if usage is None or not obj.get("choices"):
            return [obj] if changed else None
        # usage in a chunk that has choices: its own chunk after it, or none when hidden
        del obj["usage"]
        if self.hide:
            return [obj]
        return [obj, {**obj, "choices": [], "usage": usage}]


def _stream_error(obj: dict[str, Any], a: Asked) -> dict[str, Any]:
    """An error event mid-stream (vLLM, SGLang) in OpenAI's error shape."""
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else obj.get("code")
    status = code if type(code) is int and 400 <= code < 600 else 500
    path = next(p for p, k in KINDS.items() if k == a.kind)
    e = engine_error(status, orjson.dumps(obj), "application/json", path)
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}

