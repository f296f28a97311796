"""Fair share under overload (M16): the policy's decisions on a fake clock.

``FairShare`` is pure: these tests step it by hand — requests enter, slots free up —
and read which tenant each freed slot went to.
"""

from __future__ import annotations

import weakref
from collections import Counter

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.routing.fair_share import PASSED, QUEUE_FULL, FairShare, Pool, Ticket


def _policy(
    clock: FakeClock,
    *,
    max_queue: int = 1000,
    max_wait_s: float = 30.0,
    weights: dict[str, float] | None = None,
    priority: frozenset[str] = frozenset(),
    linger_s: float = 0.0,
) -> FairShare:
    return FairShare(
        max_queue=max_queue,
        max_wait_s=max_wait_s,
        now=clock.monotonic,
        weights=weights,
        priority=priority,
        linger_s=linger_s,
    )


def _fill(fs: FairShare, pool: Pool, tenant: str) -> None:
    """Take every free slot of ``pool`` (they pass straight through)."""
    while pool.in_flight < pool.capacity:
        assert fs.enter(pool, tenant) is PASSED


def _queue(fs: FairShare, pool: Pool, tenant: str, n: int) -> list[Ticket]:
    out = []
    for _ in range(n):
        t = fs.enter(pool, tenant)
        assert isinstance(t, Ticket)
        out.append(t)
    return out


def _serve(fs: FairShare, pool: Pool, n: int, holder: str = "a") -> list[str]:
    """Free ``n`` slots one after another, the oldest holder's first (``holder``'s
    slots taken by ``_fill`` before any granted one): the tenants they went to, in order."""
    holders = _holders.setdefault(pool, [holder] * pool.in_flight)
    order: list[str] = []
    for _ in range(n):
        granted = fs.leave(pool, holders.pop(0))
        assert len(granted) <= 1
        order += [t.tenant for t in granted]
        holders += [t.tenant for t in granted]
    return order


# who holds each pool's slots, oldest first (the pools die with their tests)
_holders: weakref.WeakKeyDictionary[Pool, list[str]] = weakref.WeakKeyDictionary()


def test_below_capacity_requests_pass_and_queue_nothing() -> None:
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 3)
    assert [fs.enter(pool, "a") for _ in range(3)] == [PASSED] * 3
    assert pool.in_flight == 3 and pool.queued == 0
    assert isinstance(fs.enter(pool, "a"), Ticket)  # the 4th waits
    assert fs.leave(pool, "a")[0].tenant == "a"  # and gets the slot the first one frees
    assert pool.in_flight == 3 and pool.queued == 0


@pytest.mark.feature("M16")
def test_a_flooding_tenant_does_not_delay_a_quiet_one_behind_its_backlog() -> None:
    """Tenant a has 50 requests queued; b's one request goes at the second freed slot
    (after a's head, which arrived first at the same virtual time), not the 51st."""
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 2)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 50)
    _queue(fs, pool, "b", 1)
    assert _serve(fs, pool, 3) == ["a", "b", "a"]


@pytest.mark.feature("M16")
def test_two_backlogged_tenants_share_slots_equally_whatever_their_backlog() -> None:
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 4)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 100)  # 10x b's
    _queue(fs, pool, "b", 10)
    got = Counter(_serve(fs, pool, 20))
    assert got == {"a": 10, "b": 10}
    # once b's queue is empty, a has every slot
    assert Counter(_serve(fs, pool, 10)) == {"a": 10}


def test_weights_split_slots_in_proportion() -> None:
    fs = _policy(FakeClock(), weights={"a": 3.0})
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 60)
    _queue(fs, pool, "b", 60)
    got = Counter(_serve(fs, pool, 40))
    assert got == {"a": 30, "b": 10}


def test_the_platforms_priority_tenant_goes_before_any_other_queue() -> None:
    fs = _policy(FakeClock(), priority=frozenset({"platform"}))
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 5)
    _queue(fs, pool, "platform", 3)
    assert _serve(fs, pool, 5) == ["platform", "platform", "platform", "a", "a"]


def test_a_full_tenant_queue_is_refused_without_touching_the_others() -> None:
    fs = _policy(FakeClock(), max_queue=2)
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 2)
    assert fs.enter(pool, "a") == QUEUE_FULL
    assert pool.queued == 2
    assert isinstance(fs.enter(pool, "b"), Ticket)  # b's own queue has room
    # max_queue 0: no waiting at all, a saturated pool refuses at once
    fs0 = _policy(FakeClock(), max_queue=0)
    p0 = fs0.pool("g1", 1)
    _fill(fs0, p0, "a")
    assert fs0.enter(p0, "a") == QUEUE_FULL


def test_a_cancelled_request_leaves_its_queue_and_is_not_counted_against_its_tenant() -> None:
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    a1, a2 = _queue(fs, pool, "a", 2)
    assert fs.cancel(a2) == []  # the newest: a's finish tag goes back
    assert pool.queued == 1 and pool.finish["a"] == a2.start
    assert fs.cancel(a1) == []
    assert pool.queued == 0 and "a" not in pool.queues
    assert fs.leave(pool, "a") == [] and pool.in_flight == 0


def test_a_slot_granted_to_a_request_whose_client_left_goes_to_the_next() -> None:
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    (a1,) = _queue(fs, pool, "a", 1)
    (b1,) = _queue(fs, pool, "b", 1)
    assert fs.leave(pool, "a") == [a1] and a1.granted
    # a1's client left before it used the slot: b1 gets it, the slot count holds
    assert fs.cancel(a1) == [b1]
    assert pool.in_flight == 1 and pool.queued == 0


def test_a_wait_is_bounded_in_time_from_when_it_was_queued() -> None:
    clock = FakeClock()
    fs = _policy(clock, max_wait_s=5.0)
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    (t1,) = _queue(fs, pool, "a", 1)
    clock.advance(2.0)
    (t2,) = _queue(fs, pool, "b", 1)
    assert fs.deadline(t1) == pytest.approx(clock.monotonic() + 3.0)
    assert fs.deadline(t2) == pytest.approx(clock.monotonic() + 5.0)


def test_capacity_follows_the_route_and_idle_pools_are_forgotten() -> None:
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 2)
    assert fs.pool("g1", 3) is pool and pool.capacity == 3
    # the wider pool lets the queue in at the next freed slot: both queued go
    assert [t.tenant for t in fs.leave(pool, "a")] == ["a", "a"]
    assert pool.in_flight == 2
    fs.leave(pool, "a")
    fs.leave(pool, "a")
    fs.prune()
    assert fs.pools == {}


def test_a_tenant_returning_after_idling_gets_no_credit_for_its_idle_time() -> None:
    """Virtual time moved on while b was away: b does not get a burst of slots ahead of a
    (its start tag is the pool's virtual time, not its old finish)."""
    fs = _policy(FakeClock())
    pool = fs.pool("g1", 1)
    _fill(fs, pool, "a")
    _queue(fs, pool, "a", 40)
    _serve(fs, pool, 20)  # a alone for a while
    _queue(fs, pool, "b", 10)
    assert Counter(_serve(fs, pool, 10)) == {"a": 5, "b": 5}


@pytest.mark.feature("M16")
def test_with_a_linger_a_flooder_holds_only_its_share_while_another_tenant_is_active() -> None:
    """linger_s: b sent a request 5 s ago (within 30 s): a, flooding, holds at most half
    of the 4 slots, so b's next request finds a free slot at once instead of waiting for
    one of a's to end."""
    clock = FakeClock()
    fs = _policy(clock, linger_s=30.0)
    pool = fs.pool("g1", 4)
    assert fs.enter(pool, "b") is PASSED
    assert fs.leave(pool, "b") == []  # b's request ended
    clock.advance(5.0)
    assert [fs.enter(pool, "a") for _ in range(2)] == [PASSED, PASSED]
    a3 = fs.enter(pool, "a")
    assert isinstance(a3, Ticket)  # two slots free, but they are b's share
    assert fs.enter(pool, "b") is PASSED  # b's request does not wait
    # b gone quiet for longer than the linger: a may use every slot again
    clock.advance(31.0)
    assert fs.leave(pool, "b") == [a3]
    assert fs.enter(pool, "a") is PASSED and pool.running == {"a": 4}


def test_with_a_linger_a_lone_tenant_still_uses_the_whole_pool() -> None:
    fs = _policy(FakeClock(), linger_s=30.0)
    pool = fs.pool("g1", 4)
    assert [fs.enter(pool, "a") for _ in range(4)] == [PASSED] * 4
    assert isinstance(fs.enter(pool, "a"), Ticket)


def test_the_share_under_a_linger_is_weighted_and_priority_is_not_capped() -> None:
    fs = _policy(FakeClock(), linger_s=30.0, weights={"a": 3.0}, priority=frozenset({"p"}))
    pool = fs.pool("g1", 8)
    assert fs.enter(pool, "b") is PASSED
    got = [fs.enter(pool, "a") for _ in range(7)]
    assert got[:6] == [PASSED] * 6 and isinstance(got[6], Ticket)  # 3/4 of 8
    assert fs.enter(pool, "p") is PASSED  # the platform's own: the last slot
