"""Leader election without a database: the lease rule, the elector and the loop runner,
stepped on a FakeClock over the in-memory lease store."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from heteroflow.controllers.base import Controller, run_loop, run_tick
from heteroflow.controllers.leadership import Leadership
from heteroflow.core.clock import FakeClock
from heteroflow.services.leadership import (
    Fence,
    InstanceInfo,
    LeaseInfo,
    LeaseLost,
    fence_holds,
    next_lease,
)
from heteroflow.testing.fake_leases import InMemoryLeaseStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TTL = 15.0


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def elector(store: InMemoryLeaseStore, holder: str, clock: FakeClock) -> Leadership:
    info = InstanceInfo(id=holder, hostname="h", pid=1, started_at=clock.now())
    return Leadership(store, holder=holder, ttl_s=TTL, interval_s=5, instance=info)


class Recorder:
    """A controller that records the instants it ran at."""

    interval_s = 0.0

    def __init__(self, name: str, leader_only: bool, fail: BaseException | None = None) -> None:
        self.name = name
        self.leader_only = leader_only
        self.fail = fail
        self.ran: list[datetime] = []

    def reconcile_once(self, now: datetime) -> None:
        self.ran.append(now)
        if self.fail is not None:
            raise self.fail


# -- the compare-and-set rule ----------------------------------------------------------


def test_a_missing_lease_is_taken_with_epoch_1() -> None:
    assert next_lease(None, "a", T0, TTL) == LeaseInfo("a", 1, at(TTL))


def test_the_holder_renews_with_the_same_epoch_even_after_expiry() -> None:
    held = LeaseInfo("a", 4, at(TTL))
    assert next_lease(held, "a", at(5), TTL) == LeaseInfo("a", 4, at(5 + TTL))
    # nobody took it meanwhile: no other epoch exists, so nothing needs fencing off
    assert next_lease(held, "a", at(60), TTL) == LeaseInfo("a", 4, at(60 + TTL))


def test_another_holder_is_refused_until_expiry_then_takes_over_with_epoch_plus_1() -> None:
    held = LeaseInfo("a", 4, at(TTL))
    assert next_lease(held, "b", at(TTL - 1), TTL) is None
    assert next_lease(held, "b", at(TTL), TTL) is None  # expires_at itself is still a's
    assert next_lease(held, "b", at(TTL + 0.001), TTL) == LeaseInfo("b", 5, at(2 * TTL + 0.001))


def test_a_fence_holds_only_for_its_holder_and_epoch_until_expiry() -> None:
    held = LeaseInfo("a", 4, at(TTL))
    assert fence_holds(held, Fence("controllers", "a", 4), at(TTL))
    assert not fence_holds(held, Fence("controllers", "a", 4), at(TTL + 0.001))
    assert not fence_holds(held, Fence("controllers", "a", 3), T0)  # a stale epoch
    assert not fence_holds(held, Fence("controllers", "b", 4), T0)
    assert not fence_holds(None, Fence("controllers", "a", 4), T0)


# -- the elector -----------------------------------------------------------------------


def test_one_of_two_electors_leads_and_the_other_takes_over_after_the_ttl() -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    a.reconcile_once(clock.now())
    b.reconcile_once(clock.now())
    assert (a.epoch(clock.now()), b.epoch(clock.now())) == (1, None)
    assert a.fence(clock.now()) == Fence("controllers", "a", 1)
    assert b.fence(clock.now()) is None

    for _ in range(5):  # renewals keep the epoch; b keeps being refused
        clock.advance(5)
        a.reconcile_once(clock.now())
        b.reconcile_once(clock.now())
        assert (a.epoch(clock.now()), b.is_leader(clock.now())) == (1, False)

    # a stops renewing (paused, killed): its own view lapses with the lease
    clock.advance(TTL)  # exactly a's expires_at: still a's
    b.reconcile_once(clock.now())
    assert (a.is_leader(clock.now()), b.is_leader(clock.now())) == (True, False)
    clock.advance(1)
    assert not a.is_leader(clock.now())
    b.reconcile_once(clock.now())
    assert b.fence(clock.now()) == Fence("controllers", "b", 2)
    # a wakes up: the store refuses it, and its old fence no longer holds
    assert not store.holds(Fence("controllers", "a", 1), clock.now())
    a.reconcile_once(clock.now())
    assert a.fence(clock.now()) is None


def test_release_hands_the_lease_over_at_once() -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    a.reconcile_once(clock.now())
    a.release(clock.now())
    assert not a.is_leader(clock.now())
    b.reconcile_once(clock.now())
    assert b.epoch(clock.now()) == 2


def test_a_failed_renewal_keeps_leadership_only_until_the_ttl() -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a = elector(store, "a", clock)
    a.reconcile_once(clock.now())
    store.fail = True
    clock.advance(10)
    assert run_tick(a, a, clock.now())  # ran, failed, logged
    assert a.is_leader(clock.now())
    clock.advance(TTL - 10 + 0.001)
    assert not a.is_leader(clock.now())


def test_every_renewal_heartbeats_the_instance() -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    a.listening_on("10.0.0.1", 3333)
    a.reconcile_once(clock.now())
    clock.advance(5)
    b.reconcile_once(clock.now())
    assert store.instances["a"][0].port == 3333
    assert store.instances["a"][1] == T0
    assert store.instances["b"][1] == at(5)


def test_the_renew_interval_must_be_shorter_than_the_ttl() -> None:
    with pytest.raises(ValueError, match="leader_renew_interval_s"):
        Leadership(InMemoryLeaseStore(), holder="a", ttl_s=5, interval_s=5)


# -- the loop runner -------------------------------------------------------------------


def test_leader_only_controllers_run_only_while_leading_every_instance_always() -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    watch_a, watch_b = Recorder("watch", True), Recorder("watch", True)
    sched_a, sched_b = Recorder("sched", False), Recorder("sched", False)

    instances = ((a, (watch_a, sched_a)), (b, (watch_b, sched_b)))

    def tick(alive: set[str]) -> None:
        """One interval: every live instance runs its elector, then its controllers."""
        for el, ctrls in instances:
            if el.holder in alive:
                for c in (el, *ctrls):
                    run_tick(c, el, clock.now())
        clock.advance(5)

    for _ in range(4):  # t = 0, 5, 10, 15
        tick({"a", "b"})
    assert (len(watch_a.ran), len(watch_b.ran)) == (4, 0)
    assert (len(sched_a.ran), len(sched_b.ran)) == (4, 4)

    for _ in range(5):  # a died; t = 20 .. 40
        tick({"b"})
    assert len(watch_a.ran) == 4
    # a's last renewal at t=15 holds to t=30 inclusive; b takes over at its t=35 tick
    assert watch_b.ran == [at(35), at(40)]
    assert len(sched_b.ran) == 9


def test_a_tick_logs_failures_and_refused_writes_and_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a = elector(store, "a", clock)
    a.reconcile_once(clock.now())
    lost = Recorder("lost", True, LeaseLost("epoch 1 is gone"))
    broken = Recorder("broken", False, RuntimeError("boom"))
    assert run_tick(lost, a, clock.now())
    assert run_tick(broken, a, clock.now())
    assert "lost round refused: epoch 1 is gone" in caplog.text
    assert "broken round failed" in caplog.text


async def test_run_loop_passes_the_clock_and_stops_at_once() -> None:
    clock, store = FakeClock(T0), InMemoryLeaseStore()
    a = elector(store, "a", clock)
    stop = asyncio.Event()
    seen: list[datetime] = []

    class Stepper:
        name, interval_s, leader_only = "stepper", 0.0, True

        def reconcile_once(self, now: datetime) -> None:
            seen.append(now)
            clock.advance(1)
            if len(seen) == 3:
                stop.set()

    stepper: Controller = Stepper()
    a.reconcile_once(clock.now())
    await asyncio.wait_for(run_loop(stepper, clock, stop, a), timeout=5)
    assert seen == [at(0), at(1), at(2)]

    # not leading: the loop keeps ticking without running the leader-only round
    b = elector(store, "b", clock)
    stop2 = asyncio.Event()
    task = asyncio.create_task(run_loop(stepper, clock, stop2, b))
    await asyncio.sleep(0.05)
    stop2.set()
    await asyncio.wait_for(task, timeout=5)
    assert len(seen) == 3
