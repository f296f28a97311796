"""A non-stream answer assembled from a stream's events (issue 15, item 6; M13).

llama.cpp stops a generation when the connection of a *streamed* request closes, but
decodes a non-streamed one to ``max_tokens`` after its client has gone (measured on
xllamacpp 2026.10.11549). So a client's non-stream chat or completions request to a
llama.cpp backend goes upstream as a stream with usage (``as_stream``; the decision is
``upstream.Upstream.assembles``), and the relay hands its events to an ``Assembler``,
which builds the JSON answer the client asked for: the head (``id``, ``created``,
``model``, ``system_fingerprint``, and what the engine adds, e.g. ``timings``), per
choice the text (chat: ``content``, ``reasoning_content``, ``tool_calls`` joined by
their ``index``; completions: ``text``), ``finish_reason`` and ``logprobs`` (their
lists concatenated), and ``usage``. The answer is in OpenAI's chat shape
(``chat.completion``: ``logprobs`` and ``refusal`` present) or the engine's completions
shape; the relay then fixes it as any non-stream answer (``normalize`` through
``usage.UsageTracker.assembled``: completions ids and logprobs, echo).

An error event becomes that error (OpenAI-shaped: ``engine_errors``); a stream that ends
before ``[DONE]`` (or an error) is a 502, never a truncated answer passed off as whole.

Usage is the one of choice 0, as llama.cpp answers a non-stream request with ``n`` > 1
(it streams one usage per choice, each counting that choice alone).

Pure: no I/O. Costs one ``orjson.loads`` per event (~the engine's per-token output).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from heteroflow.gateway.shaping.engine_errors import KINDS, engine_error
from heteroflow.gateway.wire.errors import OpenAIError

# The paths whose non-stream requests may be sent as streams and assembled.
PATHS: Final = frozenset(p for p, kind in KINDS.items() if kind != "embeddings")
_HEAD_SKIP = frozenset({"choices", "object", "usage"})


def as_stream(body: dict[str, Any]) -> dict[str, Any]:
    """The client's non-stream request as the stream to ask upstream (usage included)."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


class _Choice:
    """One choice's parts so far."""

    __slots__ = ("finish_reason", "logprobs", "reasoning", "role", "text", "tools")

    def __init__(self) -> None:
        self.role = "assistant"
        self.text: list[str] = []  # chat: content pieces; completions: text pieces
        self.reasoning: list[str] = []
        self.tools: dict[int, _ToolCall] = {}
        self.finish_reason: object = None
        self.logprobs: dict[str, Any] | None = None


class _ToolCall:
    __slots__ = ("arguments", "id", "name", "type")

    def __init__(self) -> None:
        self.id = ""
        self.type = "function"
        self.name: list[str] = []
        self.arguments: list[str] = []


class Assembler:
    """The events of one stream (``feed_sse`` bytes, or ``feed`` parsed events) and the
    non-stream answer they make (``result``)."""

    __slots__ = (
        "_chat", "_choices", "_error", "_finished", "_head", "_path", "_rest", "_usage",
        "_usage_of", "complete",
    )

    def __init__(self, path: str) -> None:
        self._path = path
        self._chat = KINDS[path] == "chat"
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: object = None
        self._usage_of = -1  # the choice the usage kept counts (-1: none yet)
        self._finished = 0  # the index of the choice that finished last
        self._error: dict[str, Any] | None = None
        self._rest = b""
        self.complete = False  # ``[DONE]`` or an error event arrived

    def feed_sse(self, chunk: bytes) -> None:
        """Bytes of the stream as they came (an event may be split across chunks)."""
        buf = self._rest + chunk if self._rest else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._rest = buf
            return
        self._rest = buf[end + 2 :]
        event = self._event
        for e in buf[:end].split(b"\n\n"):
            event(e)

    def _event(self, event: bytes) -> None:
        if event[:5] == b"data:" and b"\n" not in event:
            data = event[5:]  # the usual event: one data line
        else:
            lines = event.split(b"\n")
            data = b"\n".join(ln[5:] for ln in lines if ln[:5] == b"data:")
        try:
            obj = orjson.loads(data)  # leading and trailing blanks allowed
        except orjson.JSONDecodeError:
            if data.strip() == b"[DONE]":
                self.complete = True
            return
        if type(obj) is dict:  # llama.cpp opens a multi-prompt stream with ``null``
            self.feed(obj)

    def feed(self, event: dict[str, Any]) -> None:
        """One parsed event (a chunk, a usage chunk or an error)."""
        choices = event.get("choices")
        if choices is None and "error" in event:
            self._error = event
            self.complete = True
            return
        if self._head is None:
            self._head = {k: v for k, v in event.items() if k not in _HEAD_SKIP}
        owner = self._finished
        if type(choices) is list:
            for c in choices:
                if type(c) is dict:
                    owner = self._choice(c)
        usage = event.get("usage")
        if usage is not None and type(usage) is dict and (self._usage_of != 0 or owner == 0):
            self._usage, self._usage_of = usage, owner
            # what the engine adds to its answer (``timings``) comes with the usage
            self._head.update((k, v) for k, v in event.items() if k not in _HEAD_SKIP)

    def _choice(self, c: dict[str, Any]) -> int:
        index = c.get("index", 0)
        if type(index) is not int:
            index = 0
        ch = self._choices.get(index)
        if ch is None:
            ch = self._choices[index] = _Choice()
        if self._chat:
            delta = c.get("delta")
            if type(delta) is dict:
                content = delta.get("content")
                if len(delta) == 1 and type(content) is str:  # the usual chunk: text
                    ch.text.append(content)
                else:
                    _delta(ch, delta)
        else:
            text = c.get("text")
            if type(text) is str and text:
                ch.text.append(text)
        lp = c.get("logprobs")
        if lp is not None and type(lp) is dict:
            ch.logprobs = _merge_logprobs(ch.logprobs, lp)
        finish = c.get("finish_reason")
        if finish is not None:
            ch.finish_reason = finish
            self._finished = index
        return index

    def result(self) -> dict[str, Any] | OpenAIError:
        """The non-stream answer, or the error to answer instead (an error event; a
        stream that ended before it was complete: 502)."""
        if self._error is not None:
            return _error(self._error, self._path)
        if not self.complete:
            self._event(self._rest)  # a last event without its blank line
        if not self.complete or self._head is None:
            return OpenAIError(
                502,
                "The model backend's stream ended unexpectedly.",
                "server_error",
                None,
                "upstream_error",
            )
        out = self._head
        out["object"] = "chat.completion" if self._chat else "text_completion"
        build = _chat_choice if self._chat else _text_choice
        out["choices"] = [build(i, self._choices[i]) for i in sorted(self._choices)]
        if self._usage is not None:
            out["usage"] = self._usage
        return out


def _delta(ch: _Choice, delta: dict[str, Any]) -> None:
    role = delta.get("role")
    if isinstance(role, str):
        ch.role = role
    content = delta.get("content")
    if isinstance(content, str) and content:
        ch.text.append(content)
    reasoning = delta.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        ch.reasoning.append(reasoning)
    calls = delta.get("tool_calls")
    for pos, call in enumerate(calls if isinstance(calls, list) else ()):
        if not isinstance(call, dict):
            continue
        index = call.get("index")
        index = index if type(index) is int else pos
        tc = ch.tools.get(index)
        if tc is None:
            tc = ch.tools[index] = _ToolCall()
        if isinstance(call.get("id"), str) and call["id"]:
            tc.id = call["id"]
        if isinstance(call.get("type"), str):
            tc.type = call["type"]
        fn = call.get("function")
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str):
                tc.name.append(fn["name"])
            if isinstance(fn.get("arguments"), str):
                tc.arguments.append(fn["arguments"])


def _merge_logprobs(have: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Per-token logprobs of two chunks as one: every list joined (chat's ``content`` and
    ``refusal``; the legacy completions lists)."""
    if have is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in more.items()}
    for key, value in more.items():
        if isinstance(value, list):
            old = have.get(key)
            if isinstance(old, list):
                old += value
            else:
                have[key] = list(value)
    return have


def _chat_choice(index: int, ch: _Choice) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": ch.role,
        # OpenAI's null beside tool calls; "" for an empty answer, as llama.cpp says it
        "content": "".join(ch.text) if ch.text or not ch.tools else None,
        "refusal": None,
    }
    if ch.reasoning:
        message["reasoning_content"] = "".join(ch.reasoning)
    if ch.tools:
        message["tool_calls"] = [
            {
                "id": tc.id,
                "type": tc.type,
                "function": {"name": "".join(tc.name), "arguments": "".join(tc.arguments)},
            }
            for _, tc in sorted(ch.tools.items())
        ]
    return {
        "index": index,
        "message": message,
        "finish_reason": ch.finish_reason,
        "logprobs": ch.logprobs,
    }


def _text_choice(index: int, ch: _Choice) -> dict[str, Any]:
    return {
        "index": index,
        "text": "".join(ch.text),
        "finish_reason": ch.finish_reason,
        "logprobs": ch.logprobs,
    }


def _error(event: dict[str, Any], path: str) -> OpenAIError:
    """An error event in OpenAI's shape, with the status its code says (500 if none)."""
    err = event.get("error")
    code = err.get("code") if isinstance(err, dict) else event.get("code")
    status = code if type(code) is int and 400 <= code < 600 else 500
    return engine_error(status, orjson.dumps(event), "application/json", path)
