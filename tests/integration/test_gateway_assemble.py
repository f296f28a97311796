"""The relay's assembling path against a scripted llama.cpp-like backend (issue 15, item 6).

The backend names itself ``Server: llama.cpp`` and answers every generation as a
stream, scripted by the user message: events then ``[DONE]``, an error event, a stream
that breaks, one that ends early, one that goes on until its client leaves. The real
gateway on uvicorn must ask it for a stream when the client did not, answer the client
one JSON answer (or an OpenAI error, ejecting the backend only for its own fault), and
close the upstream stream when the client leaves. The real engine's side of the same is
test_gateway_assemble_real.py and test_gateway_soak_real.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.wire.errors import Receive, Scope, Send
from heteroflow.testing.fake_openai_backend import UvicornThread
from tests.gateway_stack import serve_gateway, snapshot, target
from tests.openai_schema import ErrorResponse, assert_conforms, conforms

KEY = "sk-assemble-0001"
MODEL = "tiny-chat"
HEAD = {"id": "chatcmpl-1", "created": 1, "model": "engine-model",
        "object": "chat.completion.chunk"}  # fmt: skip
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return _event({**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


TEXT = [_chunk({"role": "assistant", "content": None}), _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}), _chunk({}, "stop"), _event({**HEAD, "choices": [],
        "usage": USAGE})]  # fmt: skip


@dataclass
class LlamaLike:
    """A raw ASGI backend that streams every generation, as scripted by the prompt."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    left: threading.Event = field(default_factory=threading.Event)  # a ``long`` client left
    sent_long: int = 0  # events of the ``long`` stream sent before that

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"server", b"llama.cpp"), (b"content-type", b"application/json")]
        if scope["method"] == "GET":  # /v1/models, and the gateway's probes (/health)
            body = orjson.dumps({"object": "list", "data": [{"id": "engine-model"}]})
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        request = orjson.loads(raw)
        self.bodies.append(request)
        script = request["messages"][0]["content"]
        headers[1] = (b"content-type", b"text/event-stream")
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def out(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        if script == "text":
            await out(b"".join(TEXT) + b"data: [DONE]\n\n", False)
        elif script.startswith("error"):
            error: dict[str, Any] = {"message": "the slot failed", "type": "server_error"}
            if script == "error400":
                error = {"code": 400, "message": "Invalid grammar", "type": "invalid_request_error"}
            await out(TEXT[0] + _event({"error": error}), False)
        elif script == "early":
            await out(b"".join(TEXT[:3]), False)  # a clean end, but no [DONE]
        elif script == "broken":
            await out(b"".join(TEXT[:3]))
            raise RuntimeError("the engine died mid-stream")  # uvicorn drops the connection
        elif script == "long":
            gone = asyncio.ensure_future(receive())  # http.disconnect when the client leaves
            for _ in range(500):  # 10 s if nobody stops it
                if gone.done():
                    self.left.set()
                    return
                await out(_chunk({"content": "x"}))
                self.sent_long += 1
                await asyncio.sleep(0.02)


@dataclass
class Env:
    backend: LlamaLike
    app: GatewayApp
    url: str
    base: str  # the backend's


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    backend = LlamaLike()
    base = f"http://127.0.0.1:{thread.serve(backend, server_header=False)}"
    route = target("1", base, algorithm="least_connections")
    try:
        with serve_gateway(snapshot({MODEL: route}, key=KEY), thread, eject_cooldown_s=0.01) as gw:
            yield Env(backend, gw.app, gw.url, base)
    finally:
        thread.stop()


def _post(env: Env, script: str, timeout: float = 10, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": script}], **extra}
    return httpx.post(
        f"{env.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=timeout,
    )


@pytest.mark.feature("M13")
def test_a_non_stream_request_goes_upstream_as_a_stream_and_comes_back_as_json(env: Env) -> None:
    r = _post(env, "text", max_tokens=5)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    answer = r.json()
    conforms(answer)
    assert answer["choices"][0]["message"]["content"] == "Hello"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == USAGE
    sent = env.backend.bodies[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "engine-model" and sent["max_tokens"] == 5
    # a client that asks for a stream gets the stream, as before
    r = _post(env, "text", stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert b'"content":"Hel"' in r.content and b"usage" not in r.content


@pytest.mark.feature("M13")
@pytest.mark.feature("M5")
@pytest.mark.parametrize(
    ("script", "status", "code", "ejects"),
    [
        ("error400", 400, None, False),  # the engine's word on the request
        ("error", 500, None, True),  # no code: a server error
        ("broken", 502, "upstream_error", True),
        ("early", 502, "upstream_error", True),
    ],
)
def test_errors_in_the_stream_are_answered_in_openais_shape(
    env: Env, script: str, status: int, code: str | None, ejects: bool
) -> None:
    before = env.app.metrics.ejections.get(env.base, 0)
    r = _post(env, script)
    assert r.status_code == status, r.text
    assert_conforms(r.json(), ErrorResponse)
    assert r.json()["error"]["code"] == code
    # the gateway ejects after the answer went out: give it a moment
    deadline = time.monotonic() + (2.0 if ejects else 0.2)
    while time.monotonic() < deadline and env.app.metrics.ejections.get(env.base, 0) == before:
        time.sleep(0.01)
    assert env.app.metrics.ejections.get(env.base, 0) - before == int(ejects)
    time.sleep(0.02)  # past the cooldown: the next test finds the backend in routing


@pytest.mark.feature("M13")
def test_a_client_that_leaves_closes_the_upstream_stream(env: Env) -> None:
    with pytest.raises(httpx.TimeoutException):
        _post(env, "long", timeout=0.3)
    assert env.backend.left.wait(5), "the backend never saw its client leave"
    assert env.backend.sent_long < 100  # stopped within ~2 s of 10 s
