"""M15 ``prefix_affinity``: the replica holding the longest prompt prefix, bounded by
load; new prefixes by rendezvous hashing (alike in every gateway); a bounded, expiring
view, on a fake clock."""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter
from typing import Any

import pytest

from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.gateway.routing.prefix import PrefixView, prefix_keys
from heteroflow.schemas.routing import Backend, RouteTarget


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _target(n: int = 3, *, draining: int = -1) -> RouteTarget:
    backends = tuple(
        Backend(task_id=f"t{i}", base_url=f"http://r{i}:8080", draining=i == draining)
        for i in range(n)
    )
    return RouteTarget("route", "g", 0, 1, backends, "prefix_affinity")


def _body(group: int, question: str = "What is it about?") -> dict[str, Any]:
    doc = f"Document {group}. " + "".join(f"Fact {group}.{i} is true. " for i in range(100))
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": question * 40},
        ],
    }


def _serve(balancer: Balancer, t: RouteTarget, body: dict[str, Any]) -> Backend:
    """One request start to end: chosen, in flight, finished."""
    b = balancer.choose([t], body=body)
    assert b is not None
    balancer.acquire(b)
    balancer.release(b)
    return b


@pytest.mark.feature("M15")
def test_the_replica_with_the_longest_matching_prefix_wins() -> None:
    t = _target()
    balancer = Balancer(clock=_Clock())
    body = _body(1)
    keys = prefix_keys(body)
    assert len(keys) >= 5
    view = balancer.prefix_view
    view.record("route", keys[:2], "http://r0:8080")  # holds the first two blocks
    view.record("route", keys[:4], "http://r2:8080")  # holds four: the longest
    assert _serve(balancer, t, body).task_id == "t2"
    # The same conversation, one turn on: still where its history is.
    longer = {"messages": [*body["messages"], {"role": "assistant", "content": "x" * 900}]}
    assert _serve(balancer, t, longer).task_id == "t2"
    # A holder that drains is never chosen: the next longest holder is.
    assert _serve(balancer, _target(draining=2), body).task_id == "t0"


@pytest.mark.feature("M15")
def test_a_prefix_stays_on_its_replica_while_requests_do_not_overlap() -> None:
    t = _target()
    balancer = Balancer(clock=_Clock())
    for group in range(6):
        picks = {_serve(balancer, t, _body(group, q)).task_id for q in ("a? ", "b? ", "c? ")}
        assert len(picks) == 1, picks


@pytest.mark.feature("M15")
def test_a_hot_prefix_spreads_once_its_replica_is_over_the_load_bound() -> None:
    t = _target(4)
    balancer = Balancer(clock=_Clock(), prefix_load_factor=0.25, prefix_slack=2)
    body = _body(7)
    held: list[Backend] = []
    for n in range(1, 41):  # 40 concurrent requests of one prefix, none finished
        b = balancer.choose([t], body=body)
        assert b is not None
        balancer.acquire(b)
        held.append(b)
        loads = [balancer.in_flight(x) for x in t.backends]
        assert max(loads) <= max(math.ceil(1.25 * n / 4), min(loads) + 2)
        if n <= 2:  # within the slack: it stays where its prefix is
            assert loads.count(0) == 3
    assert sorted(Counter(b.task_id for b in held).values()) == [10, 10, 10, 10]


@pytest.mark.feature("M15")
def test_two_gateways_place_new_prefixes_alike_without_sharing_state() -> None:
    t = _target(3)
    one, two = Balancer(clock=_Clock()), Balancer(clock=_Clock())
    first = [_serve(one, t, _body(g)).task_id for g in range(30)]
    second = [_serve(two, t, _body(g)).task_id for g in range(30)]
    assert first == second  # same history, same loads: the same choices
    assert len(set(first)) == 3
    # Loads agree (both idle): a group already placed stays where it is, in any order.
    again = [_serve(two, t, _body(g, "Why? ")).task_id for g in reversed(range(30))]
    assert again == list(reversed(first))
    # Where the blocks held do not bind, a new prefix goes by rendezvous rank alone, so
    # a third gateway that saw other traffic first still agrees on most new groups.
    three = Balancer(clock=_Clock())
    other = [_serve(three, t, _body(g)).task_id for g in reversed(range(30))]
    agree = sum(a == b for a, b in zip(first, reversed(other), strict=True))
    assert agree >= 15, (first, other)


@pytest.mark.feature("M15")
def test_new_prefixes_fill_the_replicas_caches_evenly() -> None:
    """Rendezvous hashing alone puts 8 groups on 2 replicas 6:2 or 5:3 often enough (a
    replica then holds more than its cache keeps); bounded by the blocks each holds, no
    replica gets more than (1 + ε) x its share plus one group."""
    for n, groups in ((2, 8), (3, 12), (4, 10)):
        for seed in range(20):
            t = _target(n)
            balancer = Balancer(clock=_Clock())
            bodies = [_body(1000 * seed + g) for g in range(groups)]
            where = [_serve(balancer, t, b).task_id for b in bodies]
            placed = Counter(where)
            blocks = len(prefix_keys(bodies[0]))
            held = [balancer.prefix_view.held(b.base_url) for b in t.backends]
            assert sum(held) == groups * blocks
            share = groups / n
            assert max(placed.values()) <= math.ceil(1.25 * share) + 1, (n, seed, placed)
            # later requests of each group still go where the group is
            assert [
                _serve(balancer, t, _body(1000 * seed + g, "b? ")).task_id for g in range(groups)
            ] == where


@pytest.mark.feature("M15")
def test_the_blocks_held_follow_holders_eviction_and_expiry() -> None:
    clock = _Clock()
    view = PrefixView(clock, max_entries=4, ttl_s=60.0)
    view.record("r", (1, 2), "http://a")
    view.record("r", (1,), "http://b")
    assert (view.held("http://a"), view.held("http://b")) == (2, 1)
    for url in ("http://c", "http://d", "http://e"):  # MAX_HOLDERS: a drops out of key 1
        view.record("r", (1,), url)
    assert view.holders("r", 1) == ("http://b", "http://c", "http://d", "http://e")
    assert view.held("http://a") == 1
    view.record("r", (3, 4, 5), "http://a")  # the cap (4 entries) evicts the oldest: key 2
    assert len(view) == 4 and view.held("http://a") == 3
    clock.now += 61
    view.record("r", (9,), "http://f")  # the rest expire
    assert [view.held(u) for u in ("http://a", "http://b", "http://f")] == [0, 0, 1]
    clock.now += 61
    view.record("r", (9,), "http://g")  # an expired entry overwritten in place
    assert (view.held("http://f"), view.held("http://g")) == (0, 1)


@pytest.mark.feature("M15")
def test_no_prefix_goes_by_least_connections_and_ejected_holders_are_skipped() -> None:
    t = _target(3)
    health = PassiveHealth()
    balancer = Balancer(health, clock=_Clock())
    busy = balancer.choose([t], body={"prompt": "short"})  # no full block
    assert busy is not None
    balancer.acquire(busy)
    picks = {balancer.choose([t], body={"prompt": "short"}) for _ in range(4)}
    assert busy not in picks
    holder = _serve(balancer, t, _body(3))
    health.eject(holder.base_url, 5.0)
    assert _serve(balancer, t, _body(3)) != holder


@pytest.mark.feature("M15")
def test_the_view_forgets_after_its_ttl_on_the_injected_clock() -> None:
    clock = _Clock()
    view = PrefixView(clock, max_entries=100, ttl_s=60.0)
    view.record("r", (1, 2, 3), "http://a")
    clock.now += 30
    view.record("r", (1,), "http://b")
    assert view.holders("r", 1) == ("http://a", "http://b")
    assert view.holders("other-route", 1) == ()
    clock.now += 45  # keys 2 and 3: 75 s old; key 1: served 45 s ago
    assert view.holders("r", 2) == () and view.holders("r", 1) == ("http://a", "http://b")
    view.record("r", (9,), "http://c")  # a write drops expired entries from the front
    assert len(view) == 2


@pytest.mark.feature("M15")
def test_memory_stays_within_the_cap_under_100k_distinct_prefixes() -> None:
    clock = _Clock()
    cap = 20_000
    view = PrefixView(clock, max_entries=cap, ttl_s=3600.0)
    urls = [f"http://r{i}:8080" for i in range(4)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            clock.now += 0.001
            view.record("route", (i * 0x9E3779B97F4A7C15 & ((1 << 64) - 1),), urls[i % 4])
            if i % 10_000 == 0:
                assert len(view) <= cap
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(view) == cap
    assert grown < cap * 300, f"{grown / cap:.0f} bytes per entry"  # the documented bound
