"""Failover of requests whose backend connection failed, end to end with the openai SDK.

Two replicas behind one route; one dies (a uvicorn server stopped, or a port nothing
listens on): the requests routed to it are sent to the survivor, once at most, and only
when the connection could not be made (``gateway.retry``). A backend that received the
request and then failed is never retried elsewhere: a generation must not run twice.

Every gateway attempt is logged by wrapping its ``Upstream.open`` (the request is named
by its message text), so attempts are counted per request even for a backend that
refuses connections and so cannot count anything itself. Active probes are off in these
gateways: what is shown is the request path, not the probes' ejection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import openai
import orjson
import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.store import MemoryStore
from heteroflow.gateway.upstream import UpstreamFailure
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

KEY = "sk-test-retry-key-0001"
TENANT = "tenant-retry"
MODEL = "chat-model"
CHAT = "/v1/chat/completions"
_ids = itertools.count(1)


class Attempts:
    """The gateway's upstream attempts, in order: (request tag, backend base_url, failed)."""

    def __init__(self, gateway: GatewayApp) -> None:
        self.log: list[tuple[str, str, bool]] = []
        upstream = gateway._upstream
        original = upstream.open

        async def open_logged(
            url: str, body: bytes, backend: Backend, request_id: str = "", stream: bool = False
        ) -> Any:
            resp = await original(url, body, backend, request_id, stream)
            tag = orjson.loads(body)["messages"][0]["content"]
            self.log.append((tag, backend.base_url, isinstance(resp, UpstreamFailure)))
            return resp

        upstream.open = open_logged  # type: ignore[method-assign]

    def of(self, tag: str) -> list[str]:
        """The backends request ``tag`` was sent to, in order."""
        return [url for t, url, _ in self.log if t == tag]

    def per_request(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for tag, url, _ in self.log:
            out[tag].append(url)
        return out


@dataclass
class Gw:
    app: GatewayApp
    holder: SnapshotHolder
    url: str
    attempts: Attempts
    clients: list[openai.OpenAI] = field(default_factory=list)

    def route(self, *urls: str, **limits: Any) -> None:
        """One route, one target, these backends (round robin from the first)."""
        n = next(_ids)
        backends = tuple(Backend(f"task-{i}", u) for i, u in enumerate(urls))
        target = RouteTarget(f"route-{n}", f"group-{n}", 0, 1, backends)
        entry = KeyEntry(f"endpoint-{n}", TENANT, None, frozenset({MODEL}), **limits)
        self.holder.publish(
            RoutingSnapshot(
                version=n, keys={hash_key(KEY): entry}, routes={(TENANT, MODEL): (target,)}
            )
        )

    def client(self) -> openai.OpenAI:
        c = openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=10.0)
        self.clients.append(c)
        return c

    def served(self) -> int:
        """Requests this gateway answered 200."""
        return self.app.metrics.requests.get((CHAT, MODEL, 200), 0)


@dataclass
class Env:
    thread: UvicornThread
    b: FakeOpenAIBackend  # the survivor: never dies
    b_url: str
    gateways: list[Gw] = field(default_factory=list)

    def gateway(self, **kw: Any) -> Gw:
        holder = SnapshotHolder()
        app = GatewayApp(holder, probe_interval_s=0, **kw)
        gw = Gw(app, holder, f"http://127.0.0.1:{self.thread.serve(app)}/v1", Attempts(app))
        self.gateways.append(gw)
        return gw


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    b = FakeOpenAIBackend(["engine-b"], name="b")
    e = Env(thread, b, f"http://127.0.0.1:{thread.serve(b)}")
    try:
        yield e
    finally:
        for gw in e.gateways:
            thread.call(gw.app.aclose())
        thread.stop()


@pytest.fixture
def make_gw(env: Env) -> Iterator[Callable[..., Gw]]:
    made: list[Gw] = []

    def make(**kw: Any) -> Gw:
        gw = env.gateway(**kw)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        while gw.clients:
            gw.clients.pop().close()


def _closed_port_url() -> str:
    """A loopback port nothing listens on: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _chat(client: openai.OpenAI, tag: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": tag}],
        **kw,
    )


def test_requests_for_a_killed_replica_are_answered_by_the_survivor(
    env: Env, make_gw: Callable[..., Gw]
) -> None:
    gw = make_gw()  # default cooldown: the dead replica is ejected after its first failure
    a_thread = UvicornThread()
    a = FakeOpenAIBackend(["engine-a"], name="a")
    a_url = f"http://127.0.0.1:{a_thread.serve(a)}"
    gw.route(a_url, env.b_url)
    client = gw.client()
    # Both serve; the gateway now holds pooled keep-alive connections to a.
    assert {_chat(client, f"warm-{i}").id[0] for i in range(4)} == {"a", "b"}
    a_thread.stop()  # killed; round robin points at a again

    tags = [f"burst-{i}" for i in range(100)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        burst = list(pool.map(lambda t: _chat(client, t), tags))
    then = [f"seq-{i}" for i in range(50)]
    answers = burst + [_chat(client, t) for t in then]

    assert [r.id[0] for r in answers] == ["b"] * 150
    per = gw.attempts.per_request()
    assert all(per[t] in ([env.b_url], [a_url, env.b_url]) for t in tags + then)
    failed_over = sum(len(per[t]) == 2 for t in tags + then)
    assert failed_over >= 1  # the request round robin gave the dead replica
    assert gw.app.metrics.failovers == {a_url: failed_over}
    assert gw.app.metrics.ejections.get(a_url, 0) >= 1
    assert len(a.received) == 2  # the two warm-up requests, nothing more


def test_every_request_routed_to_a_dead_replica_is_sent_on_once_and_counted_once(
    env: Env, make_gw: Callable[..., Gw]
) -> None:
    # Cooldown 0: the dead replica stays in rotation, so every other request meets it (the
    # requests already queued for a replica when it dies), streams included. A frozen
    # clock makes the rate limit exact: 12 admissions, whatever the attempts.
    clock = FakeClock(datetime(2026, 6, 1, 12, 0, tzinfo=UTC))
    gw = make_gw(eject_cooldown_s=0.0, store=MemoryStore(), clock=clock)
    dead = _closed_port_url()
    gw.route(dead, env.b_url, rpm_limit=12)
    client = gw.client()
    before = len(env.b.received)

    tags = [f"r-{i}" for i in range(8)]
    assert [_chat(client, t).id[0] for t in tags] == ["b"] * 8
    assert [len(gw.attempts.of(t)) for t in tags] == [2, 1] * 4  # round robin: a, b, a, ...
    assert all(gw.attempts.of(t) == [dead, env.b_url] for t in tags[::2])

    streams = ("stream-0", "stream-1")
    for t in streams:
        chunks = list(_chat(client, t, stream=True))
        assert chunks[0].id.startswith("b-")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [gw.attempts.of(t) for t in streams] == [[dead, env.b_url], [env.b_url]]

    idem = {"Idempotency-Key": "order-1"}
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "idem"}], extra_headers=idem
    )
    sent = len(gw.attempts.of("idem"))
    replay = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "idem"}], extra_headers=idem
    )
    assert replay.parse().id == first.parse().id
    assert replay.headers["idempotent-replayed"] == "true"
    assert len(gw.attempts.of("idem")) == sent  # the replay reached no backend

    # 8 + 2 + 1 admitted (the replay costs nothing): one more passes, then 429.
    assert _chat(client, "last").id[0] == "b"
    with pytest.raises(openai.RateLimitError):
        _chat(client, "over")
    assert gw.attempts.of("over") == []

    retried = sum(len(urls) == 2 for urls in gw.attempts.per_request().values())
    assert retried >= 5  # 4 of the 8, stream-0, maybe "idem" and "last"
    assert gw.app.metrics.failovers == {dead: retried}
    # One count per client request however many attempts: 13 answers (the replay too),
    # 12 of them by a backend.
    assert gw.served() == 13
    assert len(env.b.received) == before + 12


@pytest.mark.parametrize("cooldown_s", [5.0, 0.0])
def test_with_both_replicas_dead_the_client_gets_a_502_after_at_most_two_attempts(
    make_gw: Callable[..., Gw], cooldown_s: float
) -> None:
    gw = make_gw(eject_cooldown_s=cooldown_s)
    d1, d2 = _closed_port_url(), _closed_port_url()
    gw.route(d1, d2)
    client = gw.client()
    tags = [f"dead-{i}" for i in range(6)]
    for t in tags:
        with pytest.raises(openai.InternalServerError) as info:
            _chat(client, t)
        assert info.value.status_code == 502
        assert isinstance(info.value.body, dict)
        assert info.value.body["code"] == "upstream_error"
        assert info.value.body["type"] == "server_error"
    per = gw.attempts.per_request()
    assert per[tags[0]] == [d1, d2]  # the first meets both: one, then the other
    for t in tags:
        assert 1 <= len(per[t]) <= 2 and len(set(per[t])) == len(per[t])  # never one twice
        if cooldown_s == 0.0:
            assert len(per[t]) == 2
        elif t != tags[0]:
            # Both ejected: the first attempt fails open onto one, the failover does not.
            assert len(per[t]) == 1
    assert gw.app.metrics.requests[(CHAT, MODEL, 502)] == len(tags)


def _unanswered_backend() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose accept queue is full: Linux drops new SYNs, so a connect
    to it hangs until the connect timeout (nothing can be sent)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    fill = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(srv.getsockname())
        fill.append(c)
    return srv, fill


def test_a_connect_timeout_fails_over(make_gw: Callable[..., Gw], env: Env) -> None:
    srv, fill = _unanswered_backend()
    try:
        probe = socket.socket()
        probe.settimeout(0.3)
        try:
            probe.connect(srv.getsockname())
            pytest.skip("this kernel completes connects to a full accept queue")
        except TimeoutError:
            pass
        finally:
            probe.close()
        gw = make_gw(connect_timeout_s=0.3, upstream_timeout_s=5.0)
        stuck = f"http://127.0.0.1:{srv.getsockname()[1]}"
        gw.route(stuck, env.b_url)
        assert _chat(gw.client(), "slow-connect").id[0] == "b"
        assert gw.attempts.of("slow-connect") == [stuck, env.b_url]
        assert gw.app.metrics.failovers == {stuck: 1}
    finally:
        for s in (*fill, srv):
            s.close()


_MODELS = orjson.dumps({"object": "list", "data": [{"id": "engine-x"}]})


class _TakesRequestsThenDies:
    """Answers GET /v1/models; reads every POST whole, then closes the connection
    without answering (``partial``: after the first bytes of a status line)."""

    def __init__(self, partial: bool) -> None:
        self.partial = partial
        self.posts = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if head.startswith(b"GET /v1/models"):
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(_MODELS), _MODELS)
                    )
                    await writer.drain()
                    continue
                if head.startswith(b"GET "):  # the gateway's load scrape of /metrics
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.posts += 1
                if self.partial:
                    writer.write(b"HTTP/1.1 2")
                    await writer.drain()
                return
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


async def _start(srv: _TakesRequestsThenDies) -> asyncio.Server:
    return await asyncio.start_server(srv.handle, "127.0.0.1", 0)


@pytest.mark.parametrize(
    ("partial", "stream"),
    [(False, False), (False, True), (True, False)],
    ids=["request-read", "stream-request-read", "response-begun"],
)
def test_a_failure_after_the_request_was_sent_is_not_sent_elsewhere(
    env: Env, make_gw: Callable[..., Gw], partial: bool, stream: bool
) -> None:
    dies = _TakesRequestsThenDies(partial)
    server = env.thread.call(_start(dies))
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        gw = make_gw()
        gw.route(url, env.b_url)  # a fresh route: round robin starts at the dying one
        before = len(env.b.received)
        with pytest.raises(openai.InternalServerError) as info:
            _chat(gw.client(), "once", stream=stream)
        assert info.value.status_code == 502
        assert len(env.b.received) == before  # the survivor received nothing
        assert gw.attempts.of("once") == [url]
        assert gw.app.metrics.failovers == {}
        assert dies.posts == 1  # never resent, not even to the same backend
    finally:
        server.close()
