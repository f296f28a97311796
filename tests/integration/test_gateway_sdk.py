"""The gateway end to end: real uvicorn servers, fake engines, and the real openai SDK.

One background event loop (``UvicornThread``) serves two fake engines and the gateway;
the tests talk to the gateway with the synchronous openai SDK (and httpx where the SDK
cannot express the request). Each test publishes the snapshot it needs first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.routing.poller import PollError, SnapshotPoller
from heteroflow.gateway.wire.errors import Receive, Scope, Send
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

KEY = "sk-test-gateway-key-0001"
TENANT = "tenant-1"
# The key may call these; "unrouted-model" has no route, so it is not listed either.
KEY_MODELS = frozenset(
    {"chat-model", "text-model", "embed-model", "empty-model", "fo-model", "unrouted-model"}
)
_versions = itertools.count(1)
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT_RAW = orjson.dumps({"model": "chat-model", "messages": MSG})


def _target(
    rid: str, *urls: str, priority: int = 0, weight: int = 1, algorithm: str = "round_robin"
) -> RouteTarget:
    backends = tuple(Backend(task_id=f"task-{rid}-{i}", base_url=u) for i, u in enumerate(urls))
    return RouteTarget(
        route_id=rid,
        group_id=f"group-{rid}",
        priority=priority,
        weight=weight,
        backends=backends,
        algorithm=algorithm,
    )


def _snapshot(
    routes: dict[str, tuple[RouteTarget, ...]],
    *,
    with_key: bool = True,
    tenant_routes: dict[tuple[str, str], tuple[RouteTarget, ...]] | None = None,
) -> RoutingSnapshot:
    keys = {hash_key(KEY): KeyEntry("endpoint-1", TENANT, None, KEY_MODELS)} if with_key else {}
    all_routes = {(TENANT, m): ts for m, ts in routes.items()}
    all_routes.update(tenant_routes or {})
    return RoutingSnapshot(version=next(_versions), keys=keys, routes=all_routes)


@dataclass
class Env:
    thread: UvicornThread
    holder: SnapshotHolder
    port: int
    a: FakeOpenAIBackend
    a_url: str
    b: FakeOpenAIBackend
    b_url: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self, key: str = KEY) -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=10.0)
        self.clients.append(client)  # closed after the test: no leaked sockets
        return client

    def base_routes(self) -> dict[str, tuple[RouteTarget, ...]]:
        return {
            "chat-model": (_target("chat", self.a_url),),
            "text-model": (_target("text", self.a_url),),
            "embed-model": (_target("embed", self.b_url),),
            "empty-model": (_target("empty"),),
            "fo-model": (_target("fo0", priority=0), _target("fo1", self.b_url, priority=1)),
        }


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    a = FakeOpenAIBackend(["engine-a"], name="a")
    b = FakeOpenAIBackend(["engine-b"], name="b")
    a_url = f"http://127.0.0.1:{thread.serve(a)}"
    b_url = f"http://127.0.0.1:{thread.serve(b)}"
    holder = SnapshotHolder()
    gateway = GatewayApp(holder)
    port = thread.serve(gateway)
    try:
        yield Env(thread, holder, port, a, a_url, b, b_url)
    finally:
        thread.call(gateway.aclose())
        thread.stop()


@pytest.fixture
def gw(env: Env) -> Iterator[Env]:
    env.holder.publish(_snapshot(env.base_routes()))
    yield env
    while env.clients:
        env.clients.pop().close()


def _post(env: Env, path: str, content: bytes, key: str | None = KEY) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{env.url}{path}", content=content, headers=headers, timeout=10.0)


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.feature("M1")
@pytest.mark.feature("M6")
def test_chat_non_stream_is_relayed_with_the_model_remapped(gw: Env) -> None:
    resp = gw.client().chat.completions.create(model="chat-model", messages=MSG)
    assert resp.choices[0].message.content == "tok tok tok"
    assert resp.id.startswith("a-")
    # The engine serves "engine-a", not the route's name: the gateway renamed it, and
    # the answer names the model as it was called (issue 26), not by the engine's id.
    assert gw.a.received_models[-1] == "engine-a"
    assert resp.model == "chat-model"


@pytest.mark.feature("M1")
@pytest.mark.feature("M6")
def test_chat_stream_arrives_chunk_by_chunk(gw: Env) -> None:
    stream = gw.client().chat.completions.create(
        model="chat-model",
        messages=MSG,
        stream=True,
        extra_body={"fake_chunks": 4},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok tok tok tok"
    assert {c.model for c in chunks} == {"chat-model"}  # as called (issue 26)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.feature("M1")
@pytest.mark.feature("M6")
def test_completion_stream_and_non_stream(gw: Env) -> None:
    client = gw.client()
    resp = client.completions.create(model="text-model", prompt="say")
    assert resp.choices[0].text == "tok tok tok"
    assert resp.model == "text-model" and gw.a.received_models[-1] == "engine-a"
    parts = [
        c.choices[0].text
        for c in client.completions.create(model="text-model", prompt="say", stream=True)
        if c.choices
    ]
    assert "".join(parts) == "tok tok tok"


@pytest.mark.feature("M1")
@pytest.mark.feature("M6")
def test_embeddings(gw: Env) -> None:
    resp = gw.client().embeddings.create(model="embed-model", input=["one", "two"])
    # The SDK asks for base64 (float32, as OpenAI answers it); the fake engine answers
    # floats and the gateway encodes them (issue 15): float32 precision.
    assert [d.embedding for d in resp.data] == [pytest.approx([0.1, 0.2, 0.3])] * 2
    assert gw.b.received_models[-1] == "engine-b"


@pytest.mark.feature("M1")
def test_models_lists_only_what_the_key_may_call(gw: Env) -> None:
    other = _target("other", gw.a_url)
    gw.holder.publish(
        _snapshot(
            gw.base_routes(),
            tenant_routes={
                (TENANT, "not-on-key"): (other,),
                ("tenant-2", "chat-model-2"): (other,),
            },
        )
    )
    client = gw.client()
    ids = [m.id for m in client.models.list()]
    # model=auto (M10) is listed last when the key has a choice to make
    assert ids == ["chat-model", "embed-model", "empty-model", "fo-model", "text-model", "auto"]
    assert client.models.retrieve("chat-model").owned_by == "heteroflow"
    assert client.models.retrieve("auto").id == "auto"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-on-key")
    with pytest.raises(openai.AuthenticationError):
        gw.client("sk-wrong").models.list()


@pytest.mark.feature("M1")
def test_wrong_or_missing_key_is_401(gw: Env) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        gw.client("sk-not-a-key").chat.completions.create(model="chat-model", messages=MSG)
    assert info.value.code == "invalid_api_key"
    resp = _post(gw, "/chat/completions", b'{"model":"chat-model"}', key=None)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.feature("M1")
@pytest.mark.parametrize("model", ["no-such-model", "unrouted-model", "not-on-key"])
def test_unknown_or_forbidden_model_is_404(gw: Env, model: str) -> None:
    gw.holder.publish(
        _snapshot(
            gw.base_routes(), tenant_routes={(TENANT, "not-on-key"): (_target("nk", gw.a_url),)}
        )
    )
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().chat.completions.create(model=model, messages=MSG)
    assert info.value.code == "model_not_found"
    assert info.value.message.endswith(
        f"The model `{model}` does not exist or you do not have access to it."
    )


@pytest.mark.feature("M12")
def test_route_without_backend_is_503(gw: Env) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        gw.client().chat.completions.create(model="empty-model", messages=MSG)
    assert info.value.status_code == 503
    assert info.value.code == "no_healthy_backend"


@pytest.mark.feature("M12")
def test_priority_failover_to_the_next_level(gw: Env) -> None:
    resp = gw.client().chat.completions.create(model="fo-model", messages=MSG)
    assert resp.id.startswith("b-")


@pytest.mark.feature("M12")
def test_weights_spread_requests_and_zero_weight_is_fallback(gw: Env) -> None:
    routes = gw.base_routes()
    routes["chat-model"] = (_target("wa", gw.a_url, weight=3), _target("wb", gw.b_url, weight=1))
    gw.holder.publish(_snapshot(routes))
    client = gw.client()
    served = [
        client.chat.completions.create(model="chat-model", messages=MSG).id[0] for _ in range(8)
    ]
    assert served.count("a") == 6 and served.count("b") == 2
    routes["chat-model"] = (_target("za"), _target("zb", gw.b_url, weight=0))
    gw.holder.publish(_snapshot(routes))
    resp = client.chat.completions.create(model="chat-model", messages=MSG)
    assert resp.id.startswith("b-")


@pytest.mark.feature("M12")
def test_published_snapshot_applies_to_the_next_request(gw: Env) -> None:
    client = gw.client()
    assert client.chat.completions.create(model="chat-model", messages=MSG).id.startswith("a-")
    routes = gw.base_routes()
    routes["chat-model"] = (_target("moved", gw.b_url),)
    gw.holder.publish(_snapshot(routes))
    resp = client.chat.completions.create(model="chat-model", messages=MSG)
    assert resp.id.startswith("b-") and gw.b.received_models[-1] == "engine-b"
    gw.holder.publish(_snapshot(routes, with_key=False))
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="chat-model", messages=MSG)


@pytest.mark.feature("M6")
def test_known_model_name_is_forwarded_byte_for_byte(gw: Env) -> None:
    same = FakeOpenAIBackend(["chat-model", "other-id"], name="same")
    url = f"http://127.0.0.1:{gw.thread.serve(same)}"
    routes = gw.base_routes()
    routes["chat-model"] = (_target("same", url),)
    gw.holder.publish(_snapshot(routes))
    # Spacing and key order that an orjson round trip would not reproduce.
    raw = b'{ "messages" : [{"role":"user","content":"hi"}],  "model" : "chat-model" }'
    resp = _post(gw, "/chat/completions", raw)
    assert resp.status_code == 200
    assert same.received == [("/v1/chat/completions", raw)]


@pytest.mark.feature("M6")
def test_failed_models_lookup_keeps_the_name_and_is_retried(gw: Env) -> None:
    flaky = FakeOpenAIBackend(["engine-flaky"], name="flaky")
    flaky.models_status = 500
    url = f"http://127.0.0.1:{gw.thread.serve(flaky)}"
    routes = gw.base_routes()
    routes["chat-model"] = (_target("flaky", url),)
    gw.holder.publish(_snapshot(routes))
    client = gw.client()
    client.chat.completions.create(model="chat-model", messages=MSG)
    assert flaky.received_models[-1] == "chat-model"
    flaky.models_status = 200
    client.chat.completions.create(model="chat-model", messages=MSG)
    assert flaky.received_models[-1] == "engine-flaky"
    # cached now: a lookup would find the new id. (Counting GET /v1/models cannot tell:
    # the backend monitor's probes fall back to it on a backend without /health.)
    flaky.model_ids = ["engine-renamed"]
    client.chat.completions.create(model="chat-model", messages=MSG)
    assert flaky.received_models[-1] == "engine-flaky"


@pytest.mark.feature("M1")
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/chat/completions", b"{not json", 400, None),
        ("POST", "/chat/completions", b"[1, 2]", 400, None),
        ("POST", "/chat/completions", b'{"messages": []}', 400, "model"),
        ("POST", "/completions", b'{"model": 7}', 400, "model"),
        ("POST", "/images/generations", b"{}", 404, None),
        ("GET", "/chat/completions", b"", 405, None),
        ("POST", "/models", b"{}", 405, None),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    gw: Env, method: str, path: str, body: bytes, status: int, param: str | None
) -> None:
    resp = httpx.request(
        method,
        f"{gw.url}{path}",
        content=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=10.0,
    )
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param


@pytest.mark.feature("M1")
def test_client_disconnect_cancels_the_upstream_stream(gw: Env) -> None:
    before = gw.a.stream_disconnects
    body = orjson.dumps(
        {
            "model": "chat-model",
            "stream": True,
            "fake_chunks": 200,
            "fake_delay_ms": 20,
            "messages": MSG,
        }
    )
    with (
        httpx.Client(timeout=10.0) as http,
        http.stream(
            "POST",
            f"{gw.url}/chat/completions",
            content=body,
            headers={"authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        assert resp.status_code == 200
        next(resp.iter_raw())
    _wait_for(lambda: gw.a.stream_disconnects == before + 1)
    # The gateway is still fine afterwards.
    assert gw.client().chat.completions.create(model="chat-model", messages=MSG).id.startswith("a-")


class _DropsReusedConnections:
    """HTTP/1.1 server that answers one request per connection and closes the connection,
    unanswered, when a second one arrives on it: a backend closing an idle keep-alive
    connection just as the gateway reuses it."""

    def __init__(self) -> None:
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if served:
                    self.dropped += 1
                    return
                raw = await _read_body(reader, head)
                if head.startswith(b"GET /v1/models"):
                    out = _MODELS_S
                else:
                    out = orjson.dumps(
                        {
                            "id": "s-1",
                            "object": "chat.completion",
                            "created": 0,
                            "model": orjson.loads(raw)["model"],
                            "choices": [],
                        }
                    )
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(out), out)
                )
                await writer.drain()
                served += 1
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


_MODELS_S = orjson.dumps({"object": "list", "data": [{"id": "engine-s"}]})


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return await reader.readexactly(int(line.split(b":", 1)[1]))
    return b""


async def _breaks_streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /v1/models and /health, and every stream with one event and then a dead
    connection."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            await _read_body(reader, head)
            if head.startswith((b"GET /v1/models", b"GET /health")):
                # healthy to probes: only the streams break (passive ejection's case)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_MODELS_S), _MODELS_S)
                )
                await writer.drain()
                continue
            event = (
                b'data: {"id":"s","object":"chat.completion.chunk","created":0,'
                b'"model":"engine-s","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
            )
            await writer.drain()
            return
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


@pytest.mark.feature("M1")
def test_a_stale_pooled_connection_is_never_resent_and_the_sdk_retries(gw: Env) -> None:
    """A backend that drops a reused keep-alive connection unanswered looks exactly like
    one that read the request and died: the gateway answers 502 rather than send the
    generation twice (issue 10), and OpenAI's SDK, which retries 502s, gets its answer."""
    srv = _DropsReusedConnections()
    server = gw.thread.call(_start_server(srv.handle))
    port = server.sockets[0].getsockname()[1]
    routes = gw.base_routes()
    routes["chat-model"] = (_target("stale", f"http://127.0.0.1:{port}"),)
    gw.holder.publish(_snapshot(routes))
    try:
        # The /v1/models lookup leaves a pooled connection that the chat request reuses.
        resp = _post(gw, "/chat/completions", CHAT_RAW)
        assert resp.status_code == 502, resp.text
        assert resp.json()["error"]["code"] == "upstream_error"
        assert srv.dropped == 1  # it saw the request once: nothing was sent twice
        sdk = openai.OpenAI(base_url=gw.url, api_key=KEY, max_retries=2, timeout=10.0)
        gw.clients.append(sdk)
        reply = sdk.chat.completions.create(model="chat-model", messages=MSG)
        assert reply.model == "chat-model"  # as called (issue 26)
    finally:
        server.close()


async def _start_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> asyncio.Server:
    return await asyncio.start_server(handler, "127.0.0.1", 0)


@pytest.mark.feature("M1")
def test_broken_upstream_stream_ends_with_an_sse_error_event(gw: Env) -> None:
    server = gw.thread.call(_start_server(_breaks_streams))
    port = server.sockets[0].getsockname()[1]
    routes = gw.base_routes()
    routes["chat-model"] = (_target("broken", f"http://127.0.0.1:{port}"),)
    gw.holder.publish(_snapshot(routes))
    try:
        stream = gw.client().chat.completions.create(model="chat-model", messages=MSG, stream=True)
        received = []
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                received.append(chunk.choices[0].delta.content)
        assert received == ["tok"]  # what arrived before the break was relayed
        assert isinstance(info.value.body, dict)
        assert info.value.body["code"] == "upstream_error"
    finally:
        server.close()


@pytest.mark.feature("M5")
def test_a_backend_killed_mid_stream_gives_a_clean_error_and_is_ejected(gw: Env) -> None:
    server = gw.thread.call(_start_server(_breaks_streams))
    port = server.sockets[0].getsockname()[1]
    routes = gw.base_routes()
    routes["chat-model"] = (_target("pair", f"http://127.0.0.1:{port}", gw.a_url),)
    gw.holder.publish(_snapshot(routes))
    client = gw.client()
    try:
        broke = 0
        for _ in range(2):  # round robin: one of the first two streams hits the broken one
            try:
                for _chunk in client.chat.completions.create(
                    model="chat-model", messages=MSG, stream=True
                ):
                    pass
            except openai.APIError as exc:
                assert isinstance(exc.body, dict) and exc.body["code"] == "upstream_error"
                broke += 1
        assert broke == 1
        # ejected: round robin no longer alternates onto it during the cooldown
        for _ in range(6):
            chunks = list(client.chat.completions.create(
                model="chat-model", messages=MSG, stream=True))
            assert chunks
    finally:
        server.close()


@pytest.mark.feature("M1")
def test_unreachable_and_slow_backends_give_502_and_504(gw: Env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    routes = gw.base_routes()
    routes["chat-model"] = (_target("dead", f"http://127.0.0.1:{dead_port}"),)
    gw.holder.publish(_snapshot(routes))
    resp = _post(gw, "/chat/completions", CHAT_RAW)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_error"

    holder = SnapshotHolder(_snapshot(gw.base_routes()))
    impatient = GatewayApp(holder, upstream_timeout_s=0.3)
    port = gw.thread.serve(impatient)
    try:
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            timeout=10.0,
            content=orjson.dumps({"model": "chat-model", "messages": MSG, "fake_delay_ms": 1000}),
        )
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "upstream_timeout"
    finally:
        gw.thread.call(impatient.aclose())


class _SnapshotServer:
    """The server side of the poller's protocol, as the management API implements it."""

    def __init__(self, snapshot: RoutingSnapshot) -> None:
        self.snapshot = snapshot
        self.fail_with: int | None = None
        self.seen: list[tuple[bytes | None, bytes | None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        self.seen.append((headers.get(b"authorization"), headers.get(b"if-none-match")))
        etag = f'"{self.snapshot.version}"'.encode()
        status, body = 200, orjson.dumps(self.snapshot.to_wire())
        if scope["path"] != "/api/v1/gateway/snapshot":
            status, body = 404, b"{}"
        elif self.fail_with is not None:
            status, body = self.fail_with, b"{}"
        elif headers.get(b"if-none-match") == etag:
            status, body = 304, b""
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"etag", etag), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def test_poller_follows_the_server_snapshot(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    token = "poller-secret-token"
    first = _snapshot({"chat-model": (_target("p", env.a_url),)})
    server = _SnapshotServer(first)
    base = f"http://127.0.0.1:{env.thread.serve(server)}/"
    holder = SnapshotHolder()
    poller = SnapshotPoller(base, token, holder, interval_s=0.02)
    try:
        assert await poller.poll_once() is True
        assert holder.current == first
        assert await poller.poll_once() is False
        assert server.seen[-1] == (f"Bearer {token}".encode(), f'"{first.version}"'.encode())
        server.fail_with = 500
        with pytest.raises(PollError):
            await poller.poll_once()
        assert holder.current == first
    finally:
        await poller.aclose()

    # run(): errors are logged (without the token) and survived; changes are picked up.
    caplog.set_level(logging.DEBUG, logger="heteroflow.gateway.routing.poller")
    stop = asyncio.Event()
    task = asyncio.create_task(poller.run(stop))
    deadline = time.monotonic() + 5.0
    while len(server.seen) < 6 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    second = _snapshot({"text-model": (_target("q", env.b_url),)})
    server.snapshot, server.fail_with = second, None
    while holder.current != second and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5.0)
    assert holder.current == second
    assert "routing snapshot poll failed" in caplog.text
    assert token not in caplog.text


def _served_by(client: openai.OpenAI, n: int, **kwargs: object) -> list[str]:
    """Which fake backend ("a" or "b") answered each of ``n`` chat requests."""
    return [
        client.chat.completions.create(model="chat-model", messages=MSG, **kwargs).id[0]  # type: ignore[call-overload]
        for _ in range(n)
    ]


@pytest.mark.feature("M2")
@pytest.mark.parametrize("algorithm", ["round_robin", "random", "least_connections"])
def test_algorithms_spread_over_two_backends(gw: Env, algorithm: str) -> None:
    routes = gw.base_routes()
    routes["chat-model"] = (_target(f"m2-{algorithm}", gw.a_url, gw.b_url, algorithm=algorithm),)
    gw.holder.publish(_snapshot(routes))
    served = _served_by(gw.client(), 20)
    if algorithm == "random":  # both chosen: fails with probability 2**-19
        assert set(served) == {"a", "b"}
    else:  # one at a time: least_connections ties rotate like round-robin
        assert served.count("a") == 10 and served.count("b") == 10


@pytest.mark.feature("M2")
def test_least_connections_avoids_the_backend_busy_with_a_slow_stream(gw: Env) -> None:
    routes = gw.base_routes()
    routes["chat-model"] = (
        _target("m2-lc-slow", gw.a_url, gw.b_url, algorithm="least_connections"),
    )
    gw.holder.publish(_snapshot(routes))
    client = gw.client()
    stream = client.chat.completions.create(
        model="chat-model",
        messages=MSG,
        stream=True,
        extra_body={"fake_chunks": 3, "fake_delay_ms": 400},
    )
    chunks = iter(stream)
    first = next(chunks)
    busy = first.id[0]
    # While the stream is open, every quick request goes to the other backend.
    served = _served_by(client, 6)
    assert busy not in served and len(set(served)) == 1
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "stop"
    stream.close()
    # The stream's end released its slot: both backends take turns again.
    _wait_for(lambda: gw.a.in_flight == 0 and gw.b.in_flight == 0)
    assert sorted(_served_by(client, 2)) == ["a", "b"]


@pytest.mark.feature("M5")
def test_backend_answering_503_is_ejected_then_restored_after_the_cooldown(gw: Env) -> None:
    routes = gw.base_routes()
    routes["chat-model"] = (_target("m5-eject", gw.a_url, gw.b_url),)
    holder = SnapshotHolder(_snapshot(routes))
    app = GatewayApp(holder, eject_cooldown_s=0.5)  # its own ejection state
    port = gw.thread.serve(app)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=10.0
    )
    gw.a.fail_status = 503
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="chat-model", messages=MSG)  # a, first in turn
        assert info.value.status_code == 503  # relayed as the backend said it
        gw.a.fail_status = None  # a has recovered, but it sits out its cooldown
        assert _served_by(client, 6) == ["b"] * 6
        time.sleep(0.6)
        assert sorted(_served_by(client, 2)) == ["a", "b"]  # restored by itself
    finally:
        gw.a.fail_status = None
        client.close()
        gw.thread.call(app.aclose())


@pytest.mark.feature("M5")
def test_unreachable_backend_is_ejected_and_a_lone_ejected_backend_is_still_tried(
    gw: Env,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    routes = gw.base_routes()
    routes["chat-model"] = (_target("m5-dead", dead, gw.b_url),)
    gw.holder.publish(_snapshot(routes))
    client = gw.client()
    # dead is first in turn: refused (nothing sent), so the request fails over to b and
    # dead is ejected: the next ones go to b without trying it
    assert _served_by(client, 1) == ["b"]
    assert _served_by(client, 4) == ["b"] * 4
    # Fail-open: with every backend ejected, the gateway still tries one (502, not 503).
    routes["chat-model"] = (_target("m5-dead-alone", dead),)
    gw.holder.publish(_snapshot(routes))
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="chat-model", messages=MSG)
    assert info.value.status_code == 502


@pytest.mark.feature("M4")
def test_user_field_and_session_header_pin_a_session_to_one_backend(gw: Env) -> None:
    routes = gw.base_routes()
    routes["chat-model"] = (_target("m4-sticky", gw.a_url, gw.b_url),)
    gw.holder.publish(_snapshot(routes))
    client = gw.client()
    alice = _served_by(client, 6, user="alice")
    assert len(set(alice)) == 1
    # Without a session the route still alternates in between.
    assert sorted(_served_by(client, 2)) == ["a", "b"]
    assert _served_by(client, 3, user="alice") == alice[:3]
    # The header wins over the body's user field.
    pinned = _served_by(client, 4, extra_headers={"X-Session-Id": "conv-42"})
    assert len(set(pinned)) == 1
    assert (
        _served_by(client, 4, user="someone-else", extra_headers={"X-Session-Id": "conv-42"})
        == pinned
    )


@pytest.mark.feature("M6")
def test_a_lora_adapters_name_is_forwarded_unchanged(gw: Env) -> None:
    """An adapter (core.lora) is the engine's own name, loaded at runtime — maybe after
    the gateway cached the engine's /v1/models: renaming it to the engine's first id
    would have the base model answer in its place."""
    adapter = RouteTarget(
        route_id="lora", group_id="group-chat", priority=0, weight=1, adapter=True,
        backends=(Backend(task_id="task-chat-0", base_url=gw.a_url, group_id="group-chat"),),
    )
    snap = _snapshot(gw.base_routes(), tenant_routes={(TENANT, "chat-sql"): (adapter,)})
    keys = {hash_key(KEY): KeyEntry("endpoint-1", TENANT, None, KEY_MODELS | {"chat-sql"})}
    gw.holder.publish(RoutingSnapshot(version=next(_versions), keys=keys, routes=snap.routes))
    resp = gw.client().chat.completions.create(model="chat-sql", messages=MSG)
    assert gw.a.received_models[-1] == "chat-sql"  # not "engine-a", which it serves
    assert resp.model == "chat-sql"
    gw.client().chat.completions.create(model="chat-model", messages=MSG)
    assert gw.a.received_models[-1] == "engine-a"  # the base route is still renamed
