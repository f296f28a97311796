"""Relaying a backend's answer to the client, in OpenAI's shape (``normalize``, issue 15).

The last step of a request (``forward``): an error or JSON answer is read whole and
fixed where the engine deviates; a stream goes through event by event (``usage.feed``)
or, for a client that did not ask for one, is assembled into the JSON answer
(``assemble``). ``Watch`` is shared with the task that waits for the client to leave
(``watch_disconnect``): it cancels the relay then, which closes the upstream request and
so tells the engine to stop generating.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

from heteroflow.gateway import assemble
from heteroflow.gateway.policy.usage import UsageTracker
from heteroflow.gateway.shaping import engine_errors
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Receive, Send
from heteroflow.gateway.wire.http_conventions import stream_headers
from heteroflow.gateway.wire.http_wire import Response, WireError

# The request path's lines keep the logger name they had before app.py was split
# (operators filter on it; docs/operations.md shows it).
logger = logging.getLogger("heteroflow.gateway.app")

# Backend response headers passed on to the client; hop-by-hop and framing headers are
# the server's business (uvicorn sets content-length or chunked itself).
_RELAYED_HEADERS = (b"content-type", b"content-encoding", b"cache-control")
_SSE_ERROR_CODE = "upstream_error"


class Watch:
    """Shared between a proxied request and its disconnect watcher."""

    __slots__ = ("disconnected", "finished")

    def __init__(self) -> None:
        self.finished = False  # the final body message is being sent: nothing to cancel
        self.disconnected = False


class Relayed(NamedTuple):
    """How relaying an answer went."""

    delivered: bool  # the whole answer reached the client
    fault: bool  # the backend failed (M5: it is ejected)


async def relay(
    resp: Response,
    send: Send,
    watch: Watch,
    base_url: str,
    usage: UsageTracker,
    path: str,
    streamed: bool,
) -> Relayed:
    """Relay the backend's answer in OpenAI's shape (``normalize``, issue 15).

    An error answer (>= 400) is read whole and answered as OpenAI's error object; a
    JSON answer is fixed where the engine deviates (``usage.answer``, which also picks
    up the token usage, ``usage.usage``); a stream's events go through ``usage.feed``,
    unless the client did not ask for one (``streamed``): then it is assembled into the
    JSON answer (``_relay_assembled``). Bytes in a content-encoding are relayed as they
    came.
    """
    ctype = resp.headers.get("Content-Type") or ""
    if not streamed and resp.status < 300 and ctype.startswith("text/event-stream"):
        return await _relay_assembled(resp, send, watch, base_url, usage, path)
    # ASGI wants lower-case header names; raw_headers keep the backend's spelling.
    headers = [(n.lower(), v) for n, v in resp.raw_headers if n.lower() in _RELAYED_HEADERS]
    if resp.status >= 400 or not ctype.startswith("text/event-stream"):
        try:
            data = await resp.read()
        except TimeoutError:
            watch.finished = True
            await errors.send_error(send, errors.upstream_timeout())
            return Relayed(False, True)
        except WireError as exc:
            logger.warning(
                "backend %s: reading the answer failed: %s", base_url, type(exc).__name__
            )
            watch.finished = True
            await errors.send_error(send, errors.upstream_error())
            return Relayed(False, True)
        watch.finished = True
        readable = (resp.headers.get("Content-Encoding") or "identity") == "identity"
        if resp.status >= 400 and readable:
            err = engine_errors.engine_error(resp.status, data, ctype, path)
            await errors.send_error(send, err)
            return Relayed(True, engine_errors.is_backend_fault(err))
        if resp.status < 300:
            fixed = usage.answer(data) if readable else data
            if isinstance(fixed, errors.OpenAIError):  # e.g. dimensions it cannot give
                await errors.send_error(send, fixed)
                return Relayed(True, False)
            data = fixed
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        return Relayed(True, resp.status >= 500)
    headers = stream_headers(headers)  # issue 15: cache-control: no-cache, no proxy buffering
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    try:
        async for chunk in resp.iter_any():
            out = usage.feed(chunk)  # whole events only; the hidden usage event dropped
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        tail = usage.finish()
    except WireError as exc:
        # Headers are gone already; an SSE error event is how OpenAI clients learn that
        # the stream broke (the SDK raises APIError on it) instead of a silent truncation.
        logger.warning("backend %s: stream broke: %s", base_url, type(exc).__name__)
        err = errors.OpenAIError(
            502,
            "The model backend's stream ended unexpectedly.",
            "server_error",
            None,
            _SSE_ERROR_CODE,
        )
        # A partial event held back is dropped: the client gets a clean error event.
        tail = b"data: " + err.body() + b"\n\n"
        watch.finished = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return Relayed(False, True)
    watch.finished = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    return Relayed(True, False)


async def _relay_assembled(
    resp: Response,
    send: Send,
    watch: Watch,
    base_url: str,
    usage: UsageTracker,
    path: str,
) -> Relayed:
    """Issue 15: the stream asked for a client that wants one JSON answer (llama.cpp
    stops only a stream's generation when the client leaves: ``assemble``), answered as
    that JSON answer (``usage.assembled``), or as the error its error event says."""
    asm = assemble.Assembler(path)
    answer: dict[str, Any] | errors.OpenAIError
    try:
        async for chunk in resp.iter_any():
            asm.feed_sse(chunk)
        answer = asm.result()
    except TimeoutError:
        answer = errors.upstream_timeout()
    except WireError as exc:
        logger.warning("backend %s: stream broke: %s", base_url, type(exc).__name__)
        answer = errors.upstream_error()
    watch.finished = True
    if isinstance(answer, errors.OpenAIError):
        await errors.send_error(send, answer)
        # an error event is the engine's answer; a broken stream is its fault (M5)
        complete = asm.complete
        return Relayed(complete, engine_errors.is_backend_fault(answer) or not complete)
    data = usage.assembled(answer)
    if isinstance(data, errors.OpenAIError):  # what normalize refuses (as ``answer``)
        await errors.send_error(send, data)
        return Relayed(True, False)
    await errors.send_json(send, 200, data)
    return Relayed(True, False)


async def watch_disconnect(receive: Receive, task: asyncio.Task[object], watch: Watch) -> None:
    # After the body is read, the only message left is http.disconnect (uvicorn also
    # sends it once the response is complete, hence the ``finished`` flag).
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not watch.finished:
                watch.disconnected = True
                task.cancel()
            return
