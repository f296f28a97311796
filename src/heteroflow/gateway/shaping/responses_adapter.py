"""The ASGI exit of a ``/v1/responses`` request: the chat answer sent as a Response (M14).

``ResponsesExit`` wraps the ``send`` the relay writes the engine's chat completions
answer to, and sends the client the Responses API's answer instead:

* a 2xx JSON answer is held whole and sent as one Response object (``from_chat``), with
  its own ``content-length``;
* a 2xx stream is parsed event by event (an event may be split across body messages)
  and each chat chunk becomes its Responses events (``StreamTranslator``); ``[DONE]`` or
  the end of the body closes the Response; an ``error`` event (the engine's, or the
  gateway's when the stream broke) becomes ``error`` + ``response.failed``;
* any other status passes through untouched: it is already an OpenAI-shaped error.

It sits outside the gateway's ``_Exchange``, so metrics, extra headers and the
idempotency recorder see (and replay) the translated answer.
"""

from __future__ import annotations

from typing import Any

import orjson

from heteroflow.gateway.shaping.responses import from_chat
from heteroflow.gateway.shaping.responses_stream import StreamTranslator, encode
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Message, Send

_PASS, _JSON, _STREAM = 0, 1, 2
_EVENT_END = (b"\r\n\r\n", b"\n\n")


class ResponsesExit:
    """``send`` for one ``/v1/responses`` request answered by chat completions."""

    __slots__ = ("_body", "_mode", "_model", "_request", "_rest", "_send", "_start", "_stream")

    def __init__(self, send: Send, request: dict[str, Any], model: str) -> None:
        self._send = send
        self._request = request
        self._model = model  # the name the client routed by, not the engine's id
        self._mode = _PASS
        self._start: Message | None = None
        self._body: list[bytes] = []
        self._rest = b""
        self._stream: StreamTranslator | None = None

    async def __call__(self, msg: Message) -> None:
        kind = msg["type"]
        if kind == "http.response.start":
            await self._begin(msg)
        elif kind != "http.response.body" or self._mode == _PASS:
            await self._send(msg)
        elif self._mode == _JSON:
            self._body.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                await self._send_json(b"".join(self._body))
        else:
            more = bool(msg.get("more_body", False))
            out = self._feed(msg.get("body", b""), end=not more)
            if out or not more:
                await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _begin(self, msg: Message) -> None:
        if msg["status"] >= 300:
            await self._send(msg)  # an error: OpenAI-shaped already
            return
        ctype = b""
        for name, value in msg.get("headers", ()):
            if name == b"content-type":
                ctype = value
        if not ctype.startswith(b"text/event-stream"):
            self._mode, self._start = _JSON, msg  # sent with the translated body
            return
        self._mode = _STREAM
        self._stream = StreamTranslator(self._request, model=self._model)
        await self._send(msg)
        await self._send(
            {"type": "http.response.body", "body": encode(self._stream.start()), "more_body": True}
        )

    async def _send_json(self, data: bytes) -> None:
        assert self._start is not None
        try:
            chat = orjson.loads(data)
        except orjson.JSONDecodeError:
            chat = None
        if not isinstance(chat, dict):
            await errors.send_error(self._send, _untranslatable())
            return
        body = orjson.dumps(from_chat(chat, self._request, model=self._model))
        headers = [
            *(h for h in self._start.get("headers", ()) if h[0] != b"content-length"),
            (b"content-length", b"%d" % len(body)),
        ]
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})

    def _feed(self, data: bytes, *, end: bool) -> bytes:
        """The Responses events for the chat stream's bytes ``data`` (whole events only;
        the rest waits for the next body, or is the last event when ``end``)."""
        stream = self._stream
        assert stream is not None
        buf = self._rest + data
        events: list[bytes] = []
        while True:
            cut = min(((i, len(s)) for s in _EVENT_END if (i := buf.find(s)) >= 0), default=None)
            if cut is None:
                break
            events.append(buf[: cut[0]])
            buf = buf[cut[0] + cut[1] :]
        if end:
            events.append(buf)
            buf = b""
        self._rest = buf
        out: list[dict[str, Any]] = []
        for event in events:
            out += _translate(stream, event)
        if end:
            out += stream.finish()
        return encode(out)


def _translate(stream: StreamTranslator, event: bytes) -> list[dict[str, Any]]:
    data = b"\n".join(
        line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
    )
    if not data:
        return []
    if data == b"[DONE]":
        return stream.finish()
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(obj, dict):
        return []
    err = obj.get("error")
    if err is not None:
        message = err.get("message") if isinstance(err, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        return stream.fail(
            message if isinstance(message, str) else "The model backend's stream failed.",
            code if isinstance(code, str) else None,
        )
    return stream.chunk(obj)


def _untranslatable() -> errors.OpenAIError:
    return errors.OpenAIError(
        502,
        "The model backend's answer was not a chat completion, so it could not be "
        "turned into a Response.",
        "server_error",
        None,
        "upstream_error",
    )
