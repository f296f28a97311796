"""Routing policy beyond the basics: canary weights (M3), draining (M11), the temperature
filter and stickiness fallback (M4), engine_aware scores (M2)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import replace

import pytest

from heteroflow.gateway.backend.engine_metrics import EngineLoad
from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.schemas.routing import Backend, RouteTarget


def _backend(name: str, *, draining: bool = False, temp: int | None = None) -> Backend:
    return Backend(f"task-{name}", f"http://{name}:8000", draining=draining, temperature_c=temp)


def _target(
    rid: str,
    *backends: Backend,
    priority: int = 0,
    weight: int = 1,
    algorithm: str = "round_robin",
) -> RouteTarget:
    return RouteTarget(rid, f"g-{rid}", priority, weight, tuple(backends), algorithm)


def _picks(balancer: Balancer, targets: list[RouteTarget], n: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for _ in range(n):
        b = balancer.choose(targets)
        assert b is not None
        out[b.task_id.removeprefix("task-")] += 1
    return out


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- M3 canary --------------------------------------------------------------------------


@pytest.mark.feature("M3")
def test_canary_weight_90_10_over_2000_picks() -> None:
    stable = _target("stable", _backend("s1"), _backend("s2"), weight=90)
    canary = _target("canary", _backend("c1"), weight=10)
    picks = _picks(Balancer(), [stable, canary], 2000)
    n, p = 2000, 0.10
    sigma = math.sqrt(n * p * (1 - p))  # binomial: ~13.4
    assert abs(picks["c1"] - n * p) <= 3 * sigma
    assert abs(picks["s1"] + picks["s2"] - n * (1 - p)) <= 3 * sigma
    # the stable target's two backends share its part
    assert abs(picks["s1"] - picks["s2"]) <= 1


@pytest.mark.feature("M3")
def test_canary_requests_are_spread_not_bunched() -> None:
    stable = _target("stable", _backend("s"), weight=90)
    canary = _target("canary", _backend("c"), weight=10)
    balancer = Balancer()
    order = [balancer.choose([stable, canary]) for _ in range(100)]
    canary_at = [i for i, b in enumerate(order) if b is not None and b.task_id == "task-c"]
    assert len(canary_at) == 10
    assert all(b - a == 10 for a, b in itertools.pairwise(canary_at))


@pytest.mark.feature("M3")
def test_weight_zero_serves_only_when_every_weighted_target_is_unusable() -> None:
    health = PassiveHealth(5.0, clock=_Clock())
    a = _target("a", _backend("a"), weight=50)
    b = _target("b", _backend("b"), weight=50)
    spare = _target("spare", _backend("spare"), weight=0)
    balancer = Balancer(health)
    assert _picks(balancer, [a, b, spare], 100) == {"a": 50, "b": 50}
    health.eject("http://a:8000")
    assert _picks(balancer, [a, b, spare], 10) == {"b": 10}
    drained_b = _target("b", _backend("b", draining=True), weight=50)
    assert _picks(balancer, [a, drained_b, spare], 10) == {"spare": 10}


@pytest.mark.feature("M3")
def test_a_priority_group_without_a_healthy_backend_fails_over_to_the_next() -> None:
    health = PassiveHealth(5.0, clock=_Clock())
    first = _target("first", _backend("f1"), _backend("f2"), priority=0)
    second = _target("second", _backend("s1"), priority=1, weight=1)
    third = _target("third", _backend("t1"), priority=2)
    balancer = Balancer(health)
    assert _picks(balancer, [first, second, third], 4) == {"f1": 2, "f2": 2}
    health.eject("http://f1:8000")
    assert _picks(balancer, [first, second, third], 4) == {"f2": 4}
    health.eject("http://f2:8000")
    assert _picks(balancer, [first, second, third], 4) == {"s1": 4}
    drained = _target("second", _backend("s1", draining=True), priority=1)
    assert _picks(balancer, [first, drained, third], 4) == {"t1": 4}


# -- M11 draining -----------------------------------------------------------------------


@pytest.mark.feature("M11")
def test_a_draining_backend_gets_no_new_requests() -> None:
    t = _target("a", _backend("a1"), _backend("a2", draining=True), _backend("a3"))
    assert _picks(Balancer(), [t], 10) == {"a1": 5, "a3": 5}


@pytest.mark.feature("M11")
def test_draining_is_never_failed_open() -> None:
    # Ejection is a guess and fails open; draining is an order and never does.
    health = PassiveHealth(5.0, clock=_Clock())
    t = _target("a", _backend("a1", draining=True), _backend("a2"))
    health.eject("http://a2:8000")
    assert _picks(Balancer(health), [t], 4) == {"a2": 4}
    all_draining = _target("b", _backend("b1", draining=True), _backend("b2", draining=True))
    assert Balancer().choose([all_draining]) is None
    assert Balancer().choose([all_draining], "session") is None


@pytest.mark.feature("M11")
@pytest.mark.feature("M4")
def test_a_sticky_session_moves_off_a_draining_backend_and_stays_moved() -> None:
    a1, a2 = _backend("a1"), _backend("a2")
    balancer = Balancer()
    pinned = balancer.choose([_target("a", a1, a2)], "s")
    assert pinned == a1
    draining = _target("a", replace(a1, draining=True), a2)
    assert balancer.choose([draining], "s") == a2
    assert balancer.choose([_target("a", a1, a2)], "s") == a2  # drain cleared: no flapping


# -- M4 temperature filter and stickiness -------------------------------------------------


@pytest.mark.feature("M4")
def test_backends_on_hot_cards_are_avoided_while_a_cooler_one_exists() -> None:
    t = _target("a", _backend("hot", temp=91), _backend("warm", temp=84), _backend("unknown"))
    assert _picks(Balancer(max_temp_c=85), [t], 10) == {"warm": 5, "unknown": 5}
    # exactly at the threshold is not hotter than it
    edge = _target("a", _backend("edge", temp=85), _backend("hot", temp=86))
    assert _picks(Balancer(max_temp_c=85), [edge], 4) == {"edge": 4}


@pytest.mark.feature("M4")
def test_a_route_whose_cards_are_all_hot_still_serves() -> None:
    t = _target("a", _backend("h1", temp=95), _backend("h2", temp=99))
    assert _picks(Balancer(max_temp_c=85), [t], 4) == {"h1": 2, "h2": 2}


@pytest.mark.feature("M4")
def test_hot_primary_sends_traffic_to_a_cooler_level_and_none_disables_the_filter() -> None:
    primary = _target("p", _backend("p1", temp=90), priority=0)
    backup = _target("b", _backend("b1", temp=60), priority=1)
    assert _picks(Balancer(max_temp_c=85), [primary, backup], 3) == {"b1": 3}
    assert _picks(Balancer(max_temp_c=None), [primary, backup], 3) == {"p1": 3}


@pytest.mark.feature("M4")
def test_hot_is_preferred_to_ejected_and_ejected_to_nothing() -> None:
    health = PassiveHealth(5.0, clock=_Clock())
    t = _target("a", _backend("hot", temp=95), _backend("cool", temp=40))
    health.eject("http://cool:8000")
    assert _picks(Balancer(health, max_temp_c=85), [t], 3) == {"hot": 3}
    health.eject("http://hot:8000")
    assert sum(_picks(Balancer(health, max_temp_c=85), [t], 2).values()) == 2  # fails open


@pytest.mark.feature("M4")
def test_stickiness_falls_back_when_the_pinned_backend_gets_hot_or_unhealthy() -> None:
    clock = _Clock()
    health = PassiveHealth(5.0, clock=clock)
    balancer = Balancer(health, max_temp_c=85)
    a1, a2, a3 = _backend("a1", temp=60), _backend("a2", temp=60), _backend("a3", temp=60)
    first = balancer.choose([_target("a", a1, a2, a3)], "s")
    assert first == a1
    # A temperature change below the threshold keeps the pin (the snapshot's Backend
    # objects differ, the address does not).
    warmer = replace(a1, temperature_c=70)
    assert balancer.choose([_target("a", warmer, a2, a3)], "s") == warmer
    moved = balancer.choose([_target("a", replace(a1, temperature_c=90), a2, a3)], "s")
    assert moved is not None and moved.task_id != "task-a1"
    health.eject(moved.base_url)
    again = balancer.choose([_target("a", a1, a2, a3)], "s")
    assert again is not None and again.base_url != moved.base_url
    clock.now = 10.0  # restored: the session stays where it was re-pinned
    assert balancer.choose([_target("a", a1, a2, a3)], "s") == again


# -- M2 engine_aware --------------------------------------------------------------------


@pytest.mark.feature("M2")
def test_engine_aware_prefers_the_engine_with_the_lowest_score() -> None:
    loads: dict[str, EngineLoad] = {
        "http://a:8000": EngineLoad(running=4, waiting=3, kv_use=0.9),
        "http://b:8000": EngineLoad(running=10, waiting=0, kv_use=0.3),
        "http://c:8000": EngineLoad(running=9, waiting=2, kv_use=0.1),
    }
    t = _target("e", _backend("a"), _backend("b"), _backend("c"), algorithm="engine_aware")
    assert _picks(Balancer(loads=loads), [t], 5) == {"b": 5}


@pytest.mark.feature("M2")
def test_engine_aware_counts_requests_sent_since_the_scrape() -> None:
    loads = {
        "http://a:8000": EngineLoad(0, 0, 0.0),
        "http://b:8000": EngineLoad(0, 0, 0.0),
    }
    t = _target("e", _backend("a"), _backend("b"), algorithm="engine_aware")
    balancer = Balancer(loads=loads)
    held = []
    for _ in range(6):  # a burst between two scrapes
        b = balancer.choose([t])
        assert b is not None
        balancer.acquire(b)
        held.append(b.task_id)
    assert Counter(held) == {"task-a": 3, "task-b": 3}


@pytest.mark.feature("M2")
def test_engine_aware_without_a_scrape_for_every_candidate_is_least_connections() -> None:
    a, b = _backend("a"), _backend("b")
    loads = {"http://a:8000": EngineLoad(0, 0, 0.0)}  # b has no scrape (yet, or failed)
    t = _target("e", a, b, algorithm="engine_aware")
    balancer = Balancer(loads=loads)
    balancer.acquire(a)
    assert _picks(balancer, [t], 3) == {"b": 3}  # least connections, not a's idle score


@pytest.mark.feature("M2")
def test_engine_aware_skips_draining_and_hot_backends() -> None:
    loads = {
        "http://a:8000": EngineLoad(0, 0, 0.0),
        "http://b:8000": EngineLoad(0, 0, 0.0),
        "http://c:8000": EngineLoad(50, 9, 1.0),
    }
    t = _target(
        "e",
        _backend("a", draining=True),
        _backend("b", temp=99),
        _backend("c"),
        algorithm="engine_aware",
    )
    assert _picks(Balancer(loads=loads, max_temp_c=85), [t], 3) == {"c": 3}
