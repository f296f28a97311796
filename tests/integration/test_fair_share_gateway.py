"""M16 through the real gateway: two tenants' routes to one shared, saturated service.

The gateway (``GatewayApp`` on uvicorn) bounds the pool at one request in flight
(``per_backend=1``); its one backend is a fake engine that answers after 300 ms. Tenant
``flood`` sends twelve requests at once, tenant ``calm`` one a moment later: ``calm``'s
request is answered third (after the flooder's request in flight and the one queued
first at the same virtual time), not behind the flooder's whole backlog; the flooder's
requests beyond its queue bound are refused 429 ``rate_limit_exceeded`` with Retry-After;
the engine never had more than one request at a time; ``/metrics`` counts the refusals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from heteroflow.gateway.routing.fair_gate import FairShareSettings
from heteroflow.schemas.routing import KeyEntry, RoutingSnapshot, hash_key
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from tests.gateway_stack import Served, serve_gateway, target

FLOOD_KEY, CALM_KEY = "sk-flood-0000", "sk-calm-0000"
DELAY_MS = 300


@pytest.fixture
def stack() -> Iterator[tuple[Served, FakeOpenAIBackend]]:
    engine = FakeOpenAIBackend(["m"])
    thread = UvicornThread()
    url = f"http://127.0.0.1:{thread.serve(engine)}"
    shared = target("m", url)  # one service both tenants' routes send to
    snap = RoutingSnapshot(
        version=1,
        keys={
            hash_key(FLOOD_KEY): KeyEntry("ep-flood", "flood", None, frozenset({"m"})),
            hash_key(CALM_KEY): KeyEntry("ep-calm", "calm", None, frozenset({"m"})),
        },
        routes={("flood", "m"): (shared,), ("calm", "m"): (shared,)},
    )
    fair = FairShareSettings(per_backend=1, max_queue=4, max_wait_s=30.0, retry_after_s=3)
    try:
        with serve_gateway(snap, thread, fair_share=fair, probe_interval_s=3600.0) as gw:
            yield gw, engine
    finally:
        thread.stop()


async def _ask(
    client: httpx.AsyncClient, key: str, done: list[tuple[str, float]]
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "fake_delay_ms": DELAY_MS,
    }
    r = await client.post(
        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    if r.status_code == 200:
        done.append((key, time.monotonic()))
    return r


@pytest.mark.feature("M16")
def test_a_flooding_tenant_cannot_starve_another_on_a_saturated_pool(
    stack: tuple[Served, FakeOpenAIBackend],
) -> None:
    gw, engine = stack

    async def run() -> tuple[list[httpx.Response], httpx.Response, list[tuple[str, float]]]:
        done: list[tuple[str, float]] = []
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, limits=limits) as client:
            flood = [asyncio.create_task(_ask(client, FLOOD_KEY, done)) for _ in range(12)]
            await asyncio.sleep(0.15)  # the flood is in: one in flight, four queued
            calm = await _ask(client, CALM_KEY, done)
            return list(await asyncio.gather(*flood)), calm, done

    flood, calm, done = asyncio.run(run())
    assert calm.status_code == 200, calm.text
    statuses = sorted(r.status_code for r in flood)
    assert statuses == [200] * 5 + [429] * 7  # one in flight + max_queue 4, the rest refused
    refused = next(r for r in flood if r.status_code == 429)
    assert refused.headers["retry-after"] == "3"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    # calm's request went third, not sixth (behind the whole backlog)
    assert [k for k, _ in done].index(CALM_KEY) == 2
    assert engine.max_in_flight == 1  # the pool's bound held
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'heteroflow_gateway_fair_refusals_total{model="m",reason="queue_full"} 7' in metrics
    assert 'heteroflow_gateway_fair_wait_seconds_count{model="m"} 5' in metrics
    assert gw.app._fair.queued() == 0


def _burst_of_six(fair: FairShareSettings | None = None, slots: int = 0) -> int:
    """One tenant sends six requests at once to a one-backend route (the backend's
    ``slots`` in the snapshot); all must be answered. The engine's most in flight."""
    engine = FakeOpenAIBackend(["m"])
    thread = UvicornThread()
    try:
        plain = target("m", f"http://127.0.0.1:{thread.serve(engine)}")
        shared = dataclasses.replace(
            plain, backends=(dataclasses.replace(plain.backends[0], slots=slots),)
        )
        snap = RoutingSnapshot(
            version=1,
            keys={hash_key(FLOOD_KEY): KeyEntry("ep", "flood", None, frozenset({"m"}))},
            routes={("flood", "m"): (shared,)},
        )
        kw: dict[str, Any] = {} if fair is None else {"fair_share": fair}
        with serve_gateway(snap, thread, probe_interval_s=3600.0, **kw) as gw:

            async def run() -> list[httpx.Response]:
                done: list[tuple[str, float]] = []
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                    return list(
                        await asyncio.gather(*(_ask(client, FLOOD_KEY, done) for _ in range(6)))
                    )

            assert [r.status_code for r in asyncio.run(run())] == [200] * 6
        return engine.max_in_flight
    finally:
        thread.stop()


def test_without_a_bound_the_gate_is_off() -> None:
    """The default (per_backend 0): requests go straight to the engine, all at once."""
    assert _burst_of_six() == 6


@pytest.mark.feature("M16")
def test_a_backends_own_slots_set_its_pools_bound() -> None:
    """The snapshot says the engine runs 3 at once (its -np): the pool admits 3, not the
    setting's 1, and the rest of one tenant's burst waits its turn (no refusal)."""
    fair = FairShareSettings(per_backend=1, max_queue=8, max_wait_s=30.0, retry_after_s=3)
    assert _burst_of_six(fair, slots=3) == 3  # the engine's slots, not the setting
