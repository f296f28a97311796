"""Gateway routing end to end with the real openai SDK: canary split (M3), draining with a
stream in flight (M11), the temperature filter and stickiness fallback (M4), active
probes (M5), engine_aware on scraped engine metrics (M2) and model=auto (M10).

Fake engines run on one background uvicorn loop; each wraps a ``FakeOpenAIBackend`` with
``/health`` and ``/metrics`` pages the test controls. Waits are on observed events (a
probe or scrape reached the engine), never fixed sleeps.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.gateway.app import GatewayApp
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

KEY = "sk-test-routing-key-0001"
TENANT = "tenant-r"
MODELS = frozenset({"chat-model", "code-model", "long-model", "embed-model"})
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
_versions = itertools.count(1)

IDLE = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
QUEUED = "vllm:num_requests_running 8\nvllm:num_requests_waiting 10\nvllm:kv_cache_usage_perc 1\n"


class Engine:
    """A fake engine: OpenAI answers from ``FakeOpenAIBackend``, plus /health and /metrics."""

    def __init__(self, name: str, model_ids: list[str]) -> None:
        self.api = FakeOpenAIBackend(model_ids, name=name)
        self.health_status = 200
        self.metrics = IDLE
        self.hits: Counter[str] = Counter()
        self.url = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] == "GET" and path in ("/health", "/metrics"):
            self.hits[path] += 1
            status, body = (
                (self.health_status, b"{}") if path == "/health" else (200, self.metrics.encode())
            )
            headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.api(scope, receive, send)


@dataclass
class Env:
    thread: UvicornThread
    holder: SnapshotHolder
    url: str
    a: Engine
    b: Engine
    c: Engine  # serves every route name as its own model id (no remap): sees auto's choice
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=10.0)
        self.clients.append(client)
        return client

    def publish(self, routes: dict[str, tuple[RouteTarget, ...]]) -> None:
        keys = {hash_key(KEY): KeyEntry("endpoint-r", TENANT, None, MODELS)}
        self.holder.publish(
            RoutingSnapshot(
                version=next(_versions),
                keys=keys,
                routes={(TENANT, m): ts for m, ts in routes.items()},
            )
        )


def _target(
    rid: str,
    *backends: Backend,
    priority: int = 0,
    weight: int = 1,
    algorithm: str = "round_robin",
    tags: tuple[str, ...] = (),
) -> RouteTarget:
    return RouteTarget(rid, f"g-{rid}", priority, weight, backends, algorithm, tags)


def _b(engine: Engine, *, draining: bool = False, temp: int | None = None) -> Backend:
    return Backend(f"task-{engine.api.name}", engine.url, draining=draining, temperature_c=temp)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    a = Engine("a", ["engine-a"])
    b = Engine("b", ["engine-b"])
    c = Engine("c", sorted(MODELS))
    for e in (a, b, c):
        e.url = f"http://127.0.0.1:{thread.serve(e)}"
    holder = SnapshotHolder()
    gateway = GatewayApp(holder, probe_interval_s=0.05, probe_timeout_s=1.0, scrape_interval_s=0.05)
    port = thread.serve(gateway)
    try:
        yield Env(thread, holder, f"http://127.0.0.1:{port}/v1", a, b, c)
    finally:
        thread.call(gateway.aclose())
        thread.stop()


@pytest.fixture
def gw(env: Env) -> Iterator[Env]:
    yield env
    while env.clients:
        env.clients.pop().close()
    for e in (env.a, env.b, env.c):
        e.health_status, e.metrics = 200, IDLE


def _served(client: openai.OpenAI, n: int, model: str = "chat-model", **kw: object) -> list[str]:
    """Which engine answered each of ``n`` chat requests ("a", "b" or "c")."""
    return [
        client.chat.completions.create(model=model, messages=MSG, **kw).id[0]  # type: ignore[call-overload]
        for _ in range(n)
    ]


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _after_two_rounds(engine: Engine, path: str) -> None:
    """Block until two more probe/scrape rounds reached ``engine``: the first of them was
    fully applied (a round starts only after the previous one ended)."""
    seen = engine.hits[path]
    _wait_for(lambda: engine.hits[path] >= seen + 2)


@pytest.mark.feature("M3")
def test_canary_split_90_10_through_the_sdk(gw: Env) -> None:
    gw.publish(
        {
            "chat-model": (
                _target("stable", _b(gw.a), weight=90),
                _target("canary", _b(gw.b), weight=10),
            )
        }
    )
    # 100 requests (each costs ~45 ms on the test loop); 2,000 picks run in the unit tests
    served = Counter(_served(gw.client(), 100))
    sigma = math.sqrt(100 * 0.1 * 0.9)
    assert abs(served["b"] - 10) <= 3 * sigma and served["a"] + served["b"] == 100


@pytest.mark.feature("M3")
def test_weight_zero_fallback_and_priority_failover_through_the_sdk(gw: Env) -> None:
    gw.publish(
        {
            "chat-model": (
                _target("main", _b(gw.a, draining=True), weight=100),
                _target("spare", _b(gw.b), weight=0),
                _target("next", _b(gw.c), priority=1),
            )
        }
    )
    assert _served(gw.client(), 4) == ["b"] * 4
    gw.publish(
        {
            "chat-model": (
                _target("main", _b(gw.a, draining=True), weight=100),
                _target("spare", _b(gw.b, draining=True), weight=0),
                _target("next", _b(gw.c), priority=1),
            )
        }
    )
    assert _served(gw.client(), 4) == ["c"] * 4


@pytest.mark.feature("M11")
@pytest.mark.feature("M4")
def test_drained_backend_gets_no_new_requests_while_its_stream_finishes(gw: Env) -> None:
    client = gw.client()
    gw.publish({"chat-model": (_target("d", _b(gw.a)),)})
    session = {"X-Session-Id": "drain-session"}
    assert _served(client, 1, extra_headers=session) == ["a"]  # pinned to a
    stream = client.chat.completions.create(
        model="chat-model",
        messages=MSG,
        stream=True,
        # ~3 s of stream: it must outlast the requests below even on a loaded machine
        extra_body={"fake_chunks": 40, "fake_delay_ms": 75},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.id.startswith("a-") and gw.a.api.in_flight == 1

    gw.publish({"chat-model": (_target("d", _b(gw.a, draining=True), _b(gw.b)),)})
    received_by_a = len(gw.a.api.received)
    assert _served(client, 6) == ["b"] * 6
    assert _served(client, 2, extra_headers=session) == ["b", "b"]  # the session moved
    assert len(gw.a.api.received) == received_by_a  # nothing new reached a
    assert gw.a.api.in_flight == 1  # ... while its stream is still going

    rest = list(chunks)
    text = (first.choices[0].delta.content or "") + "".join(
        c.choices[0].delta.content or "" for c in rest if c.choices
    )
    assert text == " ".join(["tok"] * 40)
    assert rest[-1].choices[0].finish_reason == "stop"
    assert gw.a.api.stream_disconnects == 0 and gw.a.api.in_flight == 0

    gw.publish({"chat-model": (_target("d", _b(gw.a, draining=True)),)})
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="chat-model", messages=MSG)
    assert info.value.status_code == 503 and info.value.code == "no_healthy_backend"


@pytest.mark.feature("M4")
def test_hot_cards_are_avoided_but_never_leave_the_route_empty(gw: Env) -> None:
    client = gw.client()
    gw.publish({"chat-model": (_target("t", _b(gw.a, temp=95), _b(gw.b, temp=60)),)})
    assert _served(client, 6) == ["b"] * 6
    gw.publish({"chat-model": (_target("t", _b(gw.a, temp=95), _b(gw.b, temp=97)),)})
    assert Counter(_served(client, 6)) == {"a": 3, "b": 3}


@pytest.mark.feature("M5")
def test_active_probe_ejects_and_restores_a_backend(gw: Env) -> None:
    client = gw.client()
    gw.publish({"chat-model": (_target("p", _b(gw.a), _b(gw.b)),)})
    assert Counter(_served(client, 4)) == {"a": 2, "b": 2}  # the probes follow this snapshot
    gw.a.health_status = 503
    _after_two_rounds(gw.a, "/health")
    assert _served(client, 6) == ["b"] * 6
    assert gw.a.api.fail_status is None  # only the probe failed; a was never called
    gw.a.health_status = 200
    _after_two_rounds(gw.a, "/health")
    assert Counter(_served(client, 4)) == {"a": 2, "b": 2}


@pytest.mark.feature("M2")
def test_engine_aware_follows_the_engines_queues(gw: Env) -> None:
    client = gw.client()
    gw.publish({"chat-model": (_target("e", _b(gw.a), _b(gw.b), algorithm="engine_aware"),)})
    _served(client, 1)  # the gateway now scrapes this snapshot's engine_aware backends
    gw.a.metrics = QUEUED
    _after_two_rounds(gw.a, "/metrics")
    _after_two_rounds(gw.b, "/metrics")
    assert _served(client, 8) == ["b"] * 8
    gw.a.metrics, gw.b.metrics = IDLE, QUEUED
    _after_two_rounds(gw.a, "/metrics")
    _after_two_rounds(gw.b, "/metrics")
    assert _served(client, 8) == ["a"] * 8


def _auto_routes(env: Env) -> dict[str, tuple[RouteTarget, ...]]:
    return {
        "chat-model": (_target("chat", _b(env.c)),),
        "code-model": (_target("code", _b(env.c), tags=("code",)),),
        "long-model": (_target("long", _b(env.c), tags=("long-context",)),),
        "embed-model": (_target("embed", _b(env.c), tags=("embedding",)),),
    }


@pytest.mark.feature("M10")
def test_model_auto_picks_by_capability_and_prompt_length_and_says_why(gw: Env) -> None:
    gw.publish(_auto_routes(gw))
    client = gw.client()
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=MSG, extra_headers={"x-heteroflow-capabilities": "code"}
    )
    assert raw.headers["x-heteroflow-auto-model"] == (
        "code-model; reason=capabilities=code; prompt~0 tokens; least loaded 0.0 of 1"
    )
    assert raw.parse().choices[0].message.content == "tok tok tok"
    assert gw.c.api.received_models[-1] == "code-model"  # the upstream got the choice

    long_prompt: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x" * 20_000}]
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=long_prompt)
    assert raw.headers["x-heteroflow-auto-model"].startswith(
        "long-model; reason=prompt~5000 tokens; >4096: long-context"
    )
    assert gw.c.api.received_models[-1] == "long-model"

    raw_e = client.embeddings.with_raw_response.create(model="auto", input="hello")
    assert raw_e.headers["x-heteroflow-auto-model"].startswith("embed-model; ")
    assert gw.c.api.received_models[-1] == "embed-model"

    stream = client.chat.completions.create(
        model="auto",
        messages=MSG,
        stream=True,
        extra_headers={"x-heteroflow-capabilities": "long-context"},
    )
    assert {c.model for c in stream} == {"long-model"}


@pytest.mark.feature("M10")
def test_model_auto_without_a_fitting_model_is_model_not_found(gw: Env) -> None:
    gw.publish(_auto_routes(gw))
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().chat.completions.create(
            model="auto", messages=MSG, extra_headers={"x-heteroflow-capabilities": "vision"}
        )
    assert info.value.code == "model_not_found"
    assert "capabilities 'vision'" in info.value.message
