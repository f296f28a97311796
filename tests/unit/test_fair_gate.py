"""The fair-share step's waits (M16, ``gateway.routing.fair_gate``): a slot is never kept
by a request that will not use it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import MutableMapping
from typing import Any

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.inbound import Call
from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.fair_gate import FairGate
from heteroflow.gateway.routing.fair_share import Pool, Ticket
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.schemas.routing import Backend, KeyEntry, RouteTarget, RoutingSnapshot

TARGET = RouteTarget("r", "g", 0, 1, (Backend("t", "http://127.0.0.1:1"),))


def _call(tenant: str) -> Call:
    call = Call(RoutingSnapshot(1), KeyEntry("ep", tenant, None, frozenset({"m"})), b"", {}, "m")
    call.targets = (TARGET,)
    return call


def _gate(metrics: GatewayMetrics) -> FairGate:
    clock = FakeClock()
    return FairGate(
        Balancer(PassiveHealth(30.0)),
        metrics,
        per_backend=1,
        max_queue=4,
        max_wait_s=30.0,
        retry_after_s=2,
        now=clock.monotonic,
    )


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError


async def _sink(_message: MutableMapping[str, Any]) -> None:
    return None


def test_a_request_cancelled_just_after_its_slot_was_given_gives_it_back() -> None:
    async def run() -> Pool:
        gate = _gate(GatewayMetrics())
        a, b = _call("a"), _call("b")
        pool = gate.enter(a)
        assert isinstance(pool, Pool)
        ticket = gate.enter(b)
        assert isinstance(ticket, Ticket)
        waiting = asyncio.create_task(gate.wait(ticket, b, _never, _sink))
        await asyncio.sleep(0)  # b waits
        gate.leave(pool, a)  # a ends: b is given the slot...
        assert ticket.granted
        waiting.cancel()  # ...and is cancelled before it runs again
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        return pool

    pool = asyncio.run(run())
    assert pool.in_flight == 0 and pool.running == {} and pool.queued == 0


def test_a_granted_request_gets_its_slot_and_counts_its_wait() -> None:
    async def run() -> tuple[Pool | None, GatewayMetrics]:
        metrics = GatewayMetrics()
        gate = _gate(metrics)
        a, b = _call("a"), _call("b")
        pool = gate.enter(a)
        assert isinstance(pool, Pool)
        ticket = gate.enter(b)
        assert isinstance(ticket, Ticket)
        waiting = asyncio.create_task(gate.wait(ticket, b, _never, _sink))
        await asyncio.sleep(0)
        assert metrics.fair_queue == {"m": 1}
        gate.leave(pool, a)
        return await waiting, metrics

    got, metrics = asyncio.run(run())
    assert got is not None and got.running == {"b": 1}
    assert metrics.fair_queue == {"m": 0} and metrics.fair_waits["m"].count == 1


class _Sent:
    """An ASGI ``send`` that keeps what was sent."""

    def __init__(self) -> None:
        self.messages: list[MutableMapping[str, Any]] = []

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.messages.append(message)


def test_a_wait_past_max_wait_is_answered_503_with_retry_after() -> None:
    metrics = GatewayMetrics()
    sent = _Sent()

    async def run() -> Pool | None:
        gate = FairGate(
            Balancer(PassiveHealth(30.0)),
            metrics,
            per_backend=1,
            max_queue=4,
            max_wait_s=0.05,
            retry_after_s=7,
            now=time.monotonic,
        )
        assert isinstance(gate.enter(_call("a")), Pool)
        ticket = gate.enter(_call("b"))
        assert isinstance(ticket, Ticket)
        got = await gate.wait(ticket, _call("b"), _never, sent)
        assert gate.queued() == 0
        return got

    assert asyncio.run(run()) is None
    start = sent.messages[0]
    assert start["status"] == 503 and (b"retry-after", b"7") in start["headers"]
    assert b"server_overloaded" in sent.messages[1]["body"]
    assert metrics.fair_refusals == {("m", "wait_timeout"): 1}


def test_a_client_that_leaves_while_queued_is_dequeued_without_an_answer() -> None:
    metrics = GatewayMetrics()
    sent = _Sent()

    async def left() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def run() -> Pool | None:
        gate = _gate(metrics)
        assert isinstance(gate.enter(_call("a")), Pool)
        ticket = gate.enter(_call("b"))
        assert isinstance(ticket, Ticket)
        got = await gate.wait(ticket, _call("b"), left, sent)
        assert gate.queued() == 0
        return got

    assert asyncio.run(run()) is None
    assert sent.messages == []
    assert metrics.fair_refusals == {("m", "client_left"): 1}


@pytest.mark.feature("M16")
def test_a_pools_bound_is_its_backends_own_slots_where_known() -> None:
    """4 slots of a llama.cpp replica + a backend of unknown slots (the setting, 2) = 6;
    a draining backend counts nothing; each of two workers gates half, rounded up."""
    pool = (
        RouteTarget(
            "r", "g", 0, 1,
            (
                Backend("a", "http://127.0.0.1:1", slots=4),
                Backend("b", "http://127.0.0.1:2"),
                Backend("c", "http://127.0.0.1:3", slots=100, draining=True),
            ),
        ),
    )

    def admitted(workers: int) -> int:
        gate = FairGate(
            Balancer(PassiveHealth(30.0)), GatewayMetrics(), per_backend=2, max_queue=4,
            max_wait_s=30.0, retry_after_s=2, now=FakeClock().monotonic, workers=workers,
        )
        passed = 0
        for i in range(10):
            call = _call(f"t{i}")
            call.targets = pool
            got = gate.enter(call)
            if isinstance(got, Pool):
                passed += 1
            else:
                assert isinstance(got, Ticket)  # beyond the bound: queued
        return passed

    assert admitted(1) == 6
    assert admitted(2) == 3
