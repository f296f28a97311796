"""A fake OpenAI-compatible engine for gateway tests, and a thread to serve ASGI apps in.

``FakeOpenAIBackend`` is a raw ASGI app that answers like vLLM or llama.cpp's server:
``GET /v1/models`` lists its own ``model_ids`` (deliberately not the route's model name,
so the gateway's remap is exercised), ``POST /v1/chat/completions`` and
``/v1/completions`` (JSON, or SSE with ``"stream": true``) and ``/v1/embeddings``. Every
answer echoes the ``model`` it received and carries the backend's ``name`` in its ``id``,
so a test can see both the remap and which backend served. It records what it received.

Test-only request fields: ``fake_chunks`` (number of content chunks, default 3),
``fake_delay_ms`` (sleep before a non-stream answer and between stream chunks),
``fake_status`` (answer every POST with that HTTP status and an OpenAI-shaped error),
``fake_prompt_tokens`` (the prompt tokens reported in ``usage``, default 1),
``fake_tool_call`` (``{"name", "arguments"}``: the chat answer calls that tool, streamed
as llama.cpp streams it: the name first, the arguments in two pieces). Streams
honour ``stream_options.include_usage`` as OpenAI does: ``"usage": null`` in every
chunk, then one usage event with ``"choices": []`` before ``[DONE]``.
Setting ``fail_status`` on the instance does the same for every POST it receives.
``in_flight`` counts the POSTs it is answering right now (streams included).

``UvicornThread`` serves any ASGI app with uvicorn (asyncio loop, httptools) on an
ephemeral loopback port, from one background event loop, so synchronous clients (the
openai SDK) can call it from the test's thread. Production code never imports this module.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import orjson
import uvicorn

from heteroflow.gateway.wire.errors import Receive, Scope, Send

T = TypeVar("T")
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class FakeOpenAIBackend:
    def __init__(self, model_ids: Sequence[str] = ("engine-model",), *, name: str = "fake") -> None:
        self.model_ids = list(model_ids)
        self.name = name
        self.models_status = 200  # set to e.g. 500 to make /v1/models fail
        self.models_requests = 0
        self.received: list[tuple[str, bytes]] = []  # (path, raw body) of every POST
        self.stream_disconnects = 0  # streams whose client left before the end
        self.fail_status: int | None = None  # answer every POST with this status
        self.in_flight = 0
        self.max_in_flight = 0
        # like a hosted provider: every call needs "Authorization: Bearer <required_key>"
        self.required_key: str | None = None
        self._ids = itertools.count(1)

    @property
    def received_models(self) -> list[str | None]:
        return [orjson.loads(raw).get("model") for _, raw in self.received]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if self.required_key is not None:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if auth != b"Bearer " + self.required_key.encode():
                await _json(send, 401, {"error": {"message": "Incorrect API key provided."}})
                return
        if method == "GET" and path == "/v1/models":
            self.models_requests += 1
            if self.models_status != 200:
                await _json(send, self.models_status, {"error": {"message": "unavailable"}})
                return
            data = [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake"}
                for m in self.model_ids
            ]
            await _json(send, 200, {"object": "list", "data": data})
            return
        if method != "POST":
            await _json(send, 404, {"error": {"message": f"no route {method} {path}"}})
            return
        raw = await _read(receive)
        self.received.append((path, raw))
        body: dict[str, Any] = orjson.loads(raw)
        status = body.get("fake_status", self.fail_status)
        if status is not None:
            err = {"message": f"{self.name}: failing on purpose", "type": "server_error"}
            await _json(send, int(status), {"error": err})
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._answer(receive, send, path, body)
        finally:
            self.in_flight -= 1

    async def _answer(self, receive: Receive, send: Send, path: str, body: dict[str, Any]) -> None:
        delay = float(body.get("fake_delay_ms", 0)) / 1000.0
        n = int(body.get("fake_chunks", 3))
        prompt = int(body.get("fake_prompt_tokens", 1))
        model = body.get("model")
        rid = f"{self.name}-{next(self._ids)}"
        if path == "/v1/embeddings":
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            data = [
                {"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]}
                for i in range(len(inputs))
            ]
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": data,
                    "model": model,
                    "usage": {"prompt_tokens": 1, "total_tokens": 1},
                },
            )
            return
        chat = path == "/v1/chat/completions"
        if path not in ("/v1/chat/completions", "/v1/completions"):
            await _json(send, 404, {"error": {"message": f"no route POST {path}"}})
            return
        if chat and isinstance(body.get("fake_tool_call"), dict):
            await _tool_call(send, rid, model, body)
            return
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            usage = (
                {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
                if opts.get("include_usage")
                else None
            )
            await self._stream(receive, send, chat, rid, model, n, delay, usage)
            return
        await asyncio.sleep(delay)
        text = " ".join(["tok"] * n)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        )
        await _json(
            send,
            200,
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": n,
                    "total_tokens": prompt + n,
                },
            },
        )

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        chat: bool,
        rid: str,
        model: object,
        n: int,
        delay: float,
        usage: dict[str, int] | None,
    ) -> None:
        left = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            for i in range(n):
                if i and delay:
                    await asyncio.sleep(delay)
                if left.is_set():
                    self.stream_disconnects += 1
                    return
                piece = "tok" if i == 0 else " tok"
                choice = (
                    {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": piece, "finish_reason": None}
                )
                event = {
                    "id": rid,
                    "object": obj,
                    "created": 0,
                    "model": model,
                    "choices": [choice],
                }
                if usage is not None:
                    event["usage"] = None
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": b"data: " + orjson.dumps(event) + b"\n\n",
                    }
                )
            fin = (
                {"index": 0, "delta": {}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": "", "finish_reason": "stop"}
            )
            last: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": 0,
                "model": model,
                "choices": [fin],
            }
            tail = b""
            if usage is not None:
                last["usage"] = None
                summary = {**last, "choices": [], "usage": usage}
                tail = b"data: " + orjson.dumps(summary) + b"\n\n"
            await send(
                {
                    "type": "http.response.body",
                    "more_body": False,
                    "body": b"data: " + orjson.dumps(last) + b"\n\n" + tail + b"data: [DONE]\n\n",
                }
            )
        finally:
            watcher.cancel()


async def _tool_call(send: Send, rid: str, model: object, body: dict[str, Any]) -> None:
    call = body["fake_tool_call"]
    name, args = str(call["name"]), str(call.get("arguments", "{}"))
    tool = {"id": f"call-{rid}", "type": "function", "function": {"name": name, "arguments": args}}
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    head = {"id": rid, "created": 0, "model": model}
    if not body.get("stream"):
        message = {"role": "assistant", "content": None, "tool_calls": [tool]}
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
        answer = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        await _json(send, 200, answer)
        return
    half = len(args) // 2
    first = {**tool, "index": 0, "function": {"name": name, "arguments": ""}}
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": None, "tool_calls": [first]},
        {"tool_calls": [{"index": 0, "function": {"arguments": args[:half]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]},
        {},
    ]
    chunk = {**head, "object": "chat.completion.chunk"}
    ends = [None, None, None, "tool_calls"]
    events: list[dict[str, Any]] = [
        {**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": end}]}
        for d, end in zip(deltas, ends, strict=True)
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**chunk, "choices": [], "usage": usage})
    data = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    await send({"type": "http.response.body", "body": data})


async def _json(send: Send, status: int, obj: object) -> None:
    body = orjson.dumps(obj)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _read(receive: Receive) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(parts)


class UvicornThread:
    """One background event loop serving ASGI apps on ephemeral 127.0.0.1 ports."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[tuple[uvicorn.Server, Future[None]]] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run a coroutine on the server loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: Any, *, keepalive_s: float = 5.0, server_header: bool = True) -> int:
        """Start serving ``app``; returns its port once it accepts connections.

        ``server_header=False``: no ``Server: uvicorn`` (an app that names its own)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            loop="asyncio",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=int(keepalive_s),
            server_header=server_header,
        )
        server = uvicorn.Server(config)
        fut = asyncio.run_coroutine_threadsafe(_serve(server, sock), self.loop)
        self._servers.append((server, fut))
        deadline = time.monotonic() + 10.0
        while not server.started:
            if fut.done():
                fut.result()  # raises what made the server fail
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.005)
        return port

    def stop(self) -> None:
        for server, _ in self._servers:
            server.should_exit = True
        for _, fut in self._servers:
            fut.result(10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        self.loop.close()


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    await server.serve(sockets=[sock])
