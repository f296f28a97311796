"""N2: a tenant's token quota at the gateway, through a real gateway and the OpenAI SDK.

The first test runs the whole path on SQLite and PostgreSQL: an operator sets the
tenant's quota (``PATCH /api/v1/tenants/{id}``), the server's snapshot (in memory and on
the wire a separate gateway polls) carries it on the tenant's keys, and a gateway serving
that snapshot (in-memory store, a FakeClock) refuses the tenant's third request after two
keys spent its budget together. The others share one tenant budget across three gateways
through a real Redis (127.0.0.1:6379, ``HETEROFLOW_TEST_REDIS_URL``; skipped without it
unless ``HETEROFLOW_REQUIRE_REDIS=1``), and check the Lua scripts against the in-memory
policy with tenant quotas in play.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.policy.limits import OK, TENANT_QUOTA, Charge, TenantCharge, quota_period
from heteroflow.gateway.routing.store import GatewayStore, MemoryStore, RedisStore
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import REDIS_URL, Api, service_body

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
NOON = datetime(2026, 12, 1, 12, tzinfo=UTC)  # 12 h before the UTC day ends
TENANT_MESSAGE = "tenant's token quota of 8 tokens per day; it resets at 2026-12-02T00:00:00Z"


class Gateways:
    """Gateway apps serving ``keys`` (each key's models routed to one fake engine), one
    per store, on one uvicorn loop, with one frozen clock."""

    def __init__(self, keys: dict[str, KeyEntry], stores: list[GatewayStore]) -> None:
        self.thread = UvicornThread()
        self.engine = FakeOpenAIBackend(["engine-q"], name="q")
        url = f"http://127.0.0.1:{self.thread.serve(self.engine)}"
        target = RouteTarget("r", "g", 0, 1, (Backend("t", url),))
        routes: dict[tuple[str, str], tuple[RouteTarget, ...]] = {
            (e.tenant_id, m): (target,) for e in keys.values() for m in e.models
        }
        snap = RoutingSnapshot(version=1, keys=keys, routes=routes)
        self.clock = FakeClock(NOON)
        self.apps = [GatewayApp(SnapshotHolder(snap), store=s, clock=self.clock) for s in stores]
        self.urls = [f"http://127.0.0.1:{self.thread.serve(app)}/v1" for app in self.apps]
        self.clients: list[openai.OpenAI] = []

    def client(self, key: str, gateway: int = 0) -> openai.OpenAI:
        c = openai.OpenAI(base_url=self.urls[gateway], api_key=key, max_retries=0, timeout=10.0)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for app in self.apps:
            self.thread.call(app.aclose())
        self.thread.stop()


def _chat(c: openai.OpenAI, model: str) -> str:
    """One chat request; the fake engine answers 1 prompt + 3 completion tokens."""
    r = c.chat.completions.create(model=model, messages=MSG, max_tokens=5)
    return r.choices[0].message.content or ""


def _refused(c: openai.OpenAI, model: str) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as exc:
        _chat(c, model)
    return exc.value


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# --- server -> snapshot -> gateway (SQLite and PostgreSQL) -------------------------------


@pytest.mark.feature("N2")
def test_two_keys_of_a_tenant_spend_its_token_quota_together(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team-q", "quinn")
    keys: list[str] = []
    for name in ("svc-a", "svc-b"):  # two services: two endpoints, two keys
        g = api.client.post("/api/v1/task-groups", json=service_body(name=name), headers=member)
        assert g.status_code == 201, g.text
        keys.append(g.json()["api_key"])
    other = api.member(admin, "team-r", "rita")
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=other)
    other_key = g.json()["api_key"]
    tenant = api.app.publisher.refresh().keys[hash_key(keys[0])].tenant_id
    r = api.client.patch(
        f"/api/v1/tenants/{tenant}",
        json={"quota_tokens": 8, "quota_token_period": "day"},
        headers=admin,
    )
    assert r.status_code == 200, r.text

    snap = api.app.publisher.refresh()
    entries = [snap.keys[hash_key(k)] for k in keys]
    assert [(e.tenant_quota_tokens, e.tenant_quota_period) for e in entries] == [(8, "day")] * 2
    assert snap.keys[hash_key(other_key)].tenant_quota_tokens == 0  # another tenant's key
    # a separate gateway's copy: the wire form it polls
    wire = api.client.get(
        "/api/v1/gateway/snapshot", headers={"Authorization": "Bearer gw-token-for-tests"}
    ).json()
    assert wire["tenant_quotas"] == {tenant: {"quota_tokens": 8, "quota_period": "day"}}
    polled = RoutingSnapshot.from_wire(wire)
    assert [polled.keys[hash_key(k)] for k in keys] == entries

    gws = Gateways(polled.keys, [MemoryStore()])
    try:
        (ma,), (mb,) = (sorted(e.models) for e in entries)
        a, b = gws.client(keys[0]), gws.client(keys[1])
        (mo,) = polled.keys[hash_key(other_key)].models
        assert _chat(a, ma) == "tok tok tok"  # tenant: 4 tokens
        assert _chat(b, mb) == "tok tok tok"  # 8: spent
        for c, m in ((a, ma), (b, mb)):
            err = _refused(c, m)
            assert err.code == "insufficient_quota" and err.type == "insufficient_quota"
            assert TENANT_MESSAGE in err.message
            assert err.response.headers["retry-after"] == "43200"
        assert len(gws.engine.received) == 2  # the refused requests never reached it
        assert _chat(gws.client(other_key), mo) == "tok tok tok"  # another tenant: no quota
        gws.clock.advance(12 * 3600)  # the next UTC day
        assert _chat(b, mb) == "tok tok tok"
    finally:
        gws.close()

    # 0 lifts the quota: the next snapshot carries none
    r = api.client.patch(f"/api/v1/tenants/{tenant}", json={"quota_tokens": 0}, headers=admin)
    assert r.status_code == 200, r.text
    snap = api.app.publisher.refresh()
    assert snap.keys[hash_key(keys[0])].tenant_quota_tokens == 0
    assert "tenant_quotas" not in snap.to_wire()


# --- shared through Redis ----------------------------------------------------------------


def _key(endpoint: str, tenant: str = "tn-shared", **limits: Any) -> KeyEntry:
    return KeyEntry(
        endpoint,
        tenant,
        None,
        frozenset({"chat-model"}),
        tenant_quota_tokens=8,
        tenant_quota_period="day",
        **limits,
    )


@pytest.mark.feature("N2")
def test_three_gateways_on_one_redis_share_a_tenant_budget(prefix: str) -> None:
    keys = {hash_key("sk-q-a"): _key("ep-q-a"), hash_key("sk-q-b"): _key("ep-q-b")}
    gws = Gateways(keys, [RedisStore(REDIS_URL, prefix=prefix) for _ in range(3)])
    client = redis.Redis.from_url(REDIS_URL)
    counter = f"{prefix}rlt:{{tn-shared}}:q:d20261201"
    try:
        a, b = gws.client("sk-q-a", 0), gws.client("sk-q-b", 1)
        assert _chat(a, "chat-model") == "tok tok tok"
        _wait_for(lambda: int(client.get(counter) or 0) == 4)  # reconciled to 4 real tokens
        assert _chat(b, "chat-model") == "tok tok tok"
        _wait_for(lambda: int(client.get(counter) or 0) == 8)
        # spent, whichever key asks through whichever gateway
        for key, gw in (("sk-q-a", 2), ("sk-q-b", 0), ("sk-q-a", 1)):
            err = _refused(gws.client(key, gw), "chat-model")
            assert err.code == "insufficient_quota" and TENANT_MESSAGE in err.message
        assert len(gws.engine.received) == 2
        assert 0 < client.pttl(counter) <= 13 * 3600 * 1000  # the period end + 1 h
        # each key's own limits keep their own keys; the key quota's counter is untouched
        assert not client.exists(f"{prefix}rl:{{ep-q-a}}:q:d20261201")
    finally:
        client.close()
        gws.close()


@pytest.mark.feature("N2")
def test_the_redis_scripts_agree_with_the_in_memory_policy_on_tenant_quotas(
    prefix: str,
) -> None:
    """Random admissions and corrections of four keys of two tenants (key quotas, tenant
    quotas, RPM) give the same answers from both stores."""

    async def scenario(seed: int) -> set[int]:
        rnd = random.Random(seed)
        shared = RedisStore(REDIS_URL, prefix=f"{prefix}{seed}:")
        local = MemoryStore()
        now = datetime(2026, 1, 31, 23, 50, tzinfo=UTC).timestamp() * 1000
        verdicts: set[int] = set()
        try:
            for _ in range(200):
                now += rnd.choice((0, 0, 0, 7, 250, 1000, 9000, 40_000))
                n = rnd.randint(1, 4)
                tenant, tkind = f"tn-{n % 2}", ("day", "month")[n % 2]
                rpm, quota = rnd.choice((0, 0, 5)), rnd.choice((0, 0, 300))
                tquota = rnd.choice((0, 250, 400))  # an operator may change it any time
                period, end = quota_period("month", now) if quota else ("", 0.0)
                tc = TenantCharge(tenant, tquota, *quota_period(tkind, now)) if tquota else None
                cost = rnd.randint(0, 120)
                c = Charge(f"ep-{n}", rpm, 0, quota, period, end, 0, cost, tc)
                a, b = await shared.admit(c, now), await local.admit(c, now)
                assert a == b, (seed, c, a, b)
                verdicts.add(a.verdict)
                if a.verdict == OK and rnd.random() < 0.6:
                    real = rnd.randint(0, 150)
                    shared.settle(c, 0, real - c.quota_cost, now, True)
                    local.settle(c, 0, real - c.quota_cost, now, True)
                    await shared.flush()
        finally:
            await shared.aclose()
        return verdicts

    seen: set[int] = set()
    for seed in range(4):
        seen |= asyncio.run(scenario(seed))
    assert TENANT_QUOTA in seen and OK in seen  # the tenant breaker was exercised
