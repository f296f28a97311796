"""M8/M9 shared through one real Redis: three gateways, one limit; the Lua scripts agree
with the in-memory policy; Redis down fails open to per-instance memory.

Redis is 127.0.0.1:6379 (``HETEROFLOW_TEST_REDIS_URL`` to change it). Each test uses a
key prefix of its own and deletes its keys afterwards. Without a reachable Redis the
shared tests are skipped, unless ``HETEROFLOW_REQUIRE_REDIS=1`` makes that a failure.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.policy.idempotency import (
    IN_FLIGHT,
    MISMATCH,
    PROCEED,
    REPLAY,
    StoredResponse,
    fingerprint,
)
from heteroflow.gateway.policy.limits import OK, Charge, quota_period
from heteroflow.gateway.routing.store import MemoryStore, RedisStore
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import REDIS_URL

KEY = "sk-shared-limit-key"
TENANT = "tenant-shared"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class Cluster:
    """Three gateway apps, each with its own RedisStore on the same Redis and prefix."""

    def __init__(self, prefix: str, entry: KeyEntry) -> None:
        self.thread = UvicornThread()
        self.engine = FakeOpenAIBackend(["engine-s"], name="s")
        url = f"http://127.0.0.1:{self.thread.serve(self.engine)}"
        target = RouteTarget("r", "g", 0, 1, (Backend("t", url),))
        snap = RoutingSnapshot(
            version=1, keys={hash_key(KEY): entry}, routes={(TENANT, "chat-model"): (target,)}
        )
        self.clock = FakeClock(datetime(2026, 7, 1, 12, tzinfo=UTC))  # frozen unless moved
        self.stores = [RedisStore(REDIS_URL, prefix=prefix) for _ in range(3)]
        self.apps = [
            GatewayApp(SnapshotHolder(snap), store=s, clock=self.clock) for s in self.stores
        ]
        self.clients = [
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{self.thread.serve(app)}/v1",
                api_key=KEY,
                max_retries=0,
                timeout=10.0,
            )
            for app in self.apps
        ]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for app in self.apps:
            self.thread.call(app.aclose())
        self.thread.stop()


@pytest.fixture
def cluster_factory(prefix: str) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**limits: Any) -> Cluster:
        entry = KeyEntry("ep-shared", TENANT, None, frozenset({"chat-model"}), **limits)
        made.append(Cluster(prefix, entry))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.feature("M8")
def test_three_gateways_on_one_redis_enforce_one_rpm_exactly(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cl = cluster_factory(rpm_limit=30)

    def call(i: int) -> int:
        try:
            cl.clients[i % 3].chat.completions.create(model="chat-model", messages=MSG)
        except openai.RateLimitError as exc:
            assert exc.code == "rate_limit_exceeded"
            return 429
        return 200

    with ThreadPoolExecutor(max_workers=12) as pool:
        statuses = list(pool.map(call, range(60)))
    assert statuses.count(200) == 30 and statuses.count(429) == 30
    assert len(cl.engine.received) == 30
    # Two seconds later (60 s / 30) exactly one more passes, through any instance.
    cl.clock.advance(2)
    assert [call(i) for i in range(3)].count(200) == 1


@pytest.mark.feature("M8")
def test_the_quota_is_shared_and_reconciled_across_instances(
    cluster_factory: Callable[..., Cluster], prefix: str
) -> None:
    cl = cluster_factory(quota_tokens=10, quota_period="day")
    client = redis.Redis.from_url(REDIS_URL)
    counter = f"{prefix}rl:{{ep-shared}}:q:d20260701"
    try:
        for i, expected in enumerate((4, 8, 12)):  # 4 real tokens per answer
            cl.clients[i].chat.completions.create(model="chat-model", messages=MSG, max_tokens=5)
            _wait_for(lambda e=expected: int(client.get(counter) or 0) == e)  # type: ignore[misc]
        for c in cl.clients:
            with pytest.raises(openai.RateLimitError) as exc:
                c.chat.completions.create(model="chat-model", messages=MSG, max_tokens=5)
            assert exc.value.code == "insufficient_quota"
        assert 0 < client.pttl(counter) <= 13 * 3600 * 1000  # the period end + 1 h
    finally:
        client.close()


@pytest.mark.feature("M9")
def test_idempotency_keys_hold_across_instances(cluster_factory: Callable[..., Cluster]) -> None:
    cl = cluster_factory()
    kw: dict[str, Any] = {
        "model": "chat-model",
        "messages": MSG,
        "extra_body": {"fake_delay_ms": 600},
        "extra_headers": {"Idempotency-Key": "shared-1"},
    }
    got: dict[str, str] = {}
    t = threading.Thread(
        target=lambda: got.setdefault("id", cl.clients[0].chat.completions.create(**kw).id)
    )
    t.start()
    try:
        _wait_for(lambda: len(cl.engine.received) == 1)
        with pytest.raises(openai.ConflictError):
            cl.clients[1].chat.completions.create(**kw)
    finally:
        t.join(10)
    raw = cl.clients[2].chat.completions.with_raw_response.create(**kw)
    assert raw.parse().id == got["id"] and raw.headers["idempotent-replayed"] == "true"
    assert len(cl.engine.received) == 1


@pytest.mark.feature("M8")
@pytest.mark.feature("M9")
def test_the_redis_scripts_agree_with_the_in_memory_policy(prefix: str) -> None:
    """Random admissions and corrections give the same answers from both stores."""

    async def scenario(seed: int) -> None:
        rnd = random.Random(seed)
        shared = RedisStore(REDIS_URL, prefix=f"{prefix}{seed}:")
        local = MemoryStore()
        now = datetime(2026, 1, 31, 23, 58, tzinfo=UTC).timestamp() * 1000
        try:
            for _ in range(150):
                now += rnd.choice((0, 0, 0, 7, 250, 1000, 9000, 40_000))
                rpm, tpm, quota = rnd.choice((0, 3, 7)), rnd.choice((0, 50, 333)), 0
                if rnd.random() < 0.5:
                    quota = 400
                period, end = quota_period("month", now) if quota else ("", 0.0)
                cost = rnd.randint(0, 120)
                c = Charge(
                    f"ep-{rnd.randint(1, 2)}",
                    rpm,
                    tpm,
                    quota,
                    period,
                    end,
                    min(cost, tpm),
                    cost,
                )
                a, b = await shared.admit(c, now), await local.admit(c, now)
                assert a == b, (seed, c, a, b)
                if a.verdict == OK and rnd.random() < 0.6:
                    real = rnd.randint(0, 150)
                    shared.settle(c, real - c.tokens_cost, real - c.quota_cost, now, True)
                    local.settle(c, real - c.tokens_cost, real - c.quota_cost, now, True)
                    await shared.flush()
            # idempotency records: claim, conflict, mismatch, replay, release
            fp, fp2 = fingerprint("/p", b"a"), fingerprint("/p", b"b")
            first = await shared.claim("ep", b"k", fp, 60_000, now)
            assert first.kind == PROCEED and first.shared
            assert (await shared.claim("ep", b"k", fp, 60_000, now)).kind == IN_FLIGHT
            assert (await shared.claim("ep", b"k", fp2, 60_000, now)).kind == MISMATCH
            await shared.release("ep", b"k", fp, b"not-mine", True)
            assert (await shared.claim("ep", b"k", fp, 60_000, now)).kind == IN_FLIGHT
            stored = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")
            await shared.complete("ep", b"k", fp, stored.pack(), 60_000, now, True)
            replay = await shared.claim("ep", b"k", fp, 60_000, now)
            assert replay.kind == REPLAY and replay.response == stored
            assert (await shared.claim("ep", b"k", fp2, 60_000, now)).kind == MISMATCH
        finally:
            await shared.aclose()

    for seed in range(4):
        asyncio.run(scenario(seed))


@pytest.mark.feature("M8")
def test_redis_down_fails_open_to_per_instance_limits_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> list[int]:
        store = RedisStore("redis://:secret-pw@127.0.0.1:1/0", timeout_s=0.2, retry_s=0.0)
        c = Charge("ep", 2, 0, 0, "", 0.0, 0, 0)
        try:
            verdicts = []
            for _ in range(4):
                a = await store.admit(c, 1000.0)
                assert not a.shared
                verdicts.append(a.verdict)
            claim = await store.claim("ep", b"k", fingerprint("/p", b""), 1000, 1000.0)
            assert claim.kind == PROCEED and not claim.shared
            return verdicts
        finally:
            await store.aclose()

    with caplog.at_level(logging.WARNING, logger="heteroflow.gateway.routing.store"):
        verdicts = asyncio.run(scenario())
    assert verdicts == [OK, OK, 2, 2]  # RPM 2 still enforced, by this instance alone
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "unreachable" in lines[0]
    assert "secret-pw" not in lines[0] and "127.0.0.1:1" in lines[0]
