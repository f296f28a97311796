"""The gateway's backend selection policy: priority levels, weights, algorithms (M2),
passive ejection (M5) and session stickiness (M4)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.schemas.routing import Backend, RouteTarget


def _target(route_id: str, priority: int, weight: int, n_backends: int) -> RouteTarget:
    backends = tuple(
        Backend(task_id=f"{route_id}-t{i}", base_url=f"http://{route_id}-{i}:8000")
        for i in range(n_backends)
    )
    return RouteTarget(
        route_id=route_id,
        group_id=f"g-{route_id}",
        priority=priority,
        weight=weight,
        backends=backends,
    )


def _spread(balancer: Balancer, targets: list[RouteTarget], n: int) -> Counter[str]:
    picks: Counter[str] = Counter()
    for _ in range(n):
        backend = balancer.choose(targets)
        assert backend is not None
        picks[backend.task_id] += 1
    return picks


@pytest.mark.feature("M12")
def test_lowest_priority_with_a_backend_wins() -> None:
    primary = _target("a", priority=0, weight=1, n_backends=1)
    secondary = _target("b", priority=1, weight=1, n_backends=1)
    # Listed worst first on purpose: the order of the tuple must not matter.
    assert _spread(Balancer(), [secondary, primary], 10) == {"a-t0": 10}


@pytest.mark.feature("M12")
def test_empty_priority_level_fails_over_to_the_next() -> None:
    primary = _target("a", priority=0, weight=5, n_backends=0)
    secondary = _target("b", priority=1, weight=1, n_backends=1)
    tertiary = _target("c", priority=2, weight=1, n_backends=1)
    assert _spread(Balancer(), [primary, secondary, tertiary], 5) == {"b-t0": 5}


@pytest.mark.feature("M12")
def test_weights_split_requests_in_proportion_and_interleave() -> None:
    heavy = _target("a", priority=0, weight=3, n_backends=1)
    light = _target("b", priority=0, weight=1, n_backends=1)
    balancer = Balancer()
    order = [balancer.choose([heavy, light]) for _ in range(8)]
    ids = [b.task_id for b in order if b is not None]
    assert Counter(ids) == {"a-t0": 6, "b-t0": 2}
    # Smooth WRR: the light target is not starved for three picks in a row twice over.
    assert ids[:4].count("b-t0") == 1 and ids[4:].count("b-t0") == 1


@pytest.mark.feature("M12")
def test_weight_zero_is_fallback_only() -> None:
    main = _target("a", priority=0, weight=1, n_backends=1)
    fallback = _target("b", priority=0, weight=0, n_backends=1)
    assert _spread(Balancer(), [main, fallback], 6) == {"a-t0": 6}
    main_down = _target("a", priority=0, weight=1, n_backends=0)
    assert _spread(Balancer(), [main_down, fallback], 3) == {"b-t0": 3}


@pytest.mark.feature("M12")
def test_weight_zero_in_a_better_level_beats_a_worse_level() -> None:
    # Fallback-only means "inside its level": a populated level is never skipped.
    fallback = _target("a", priority=0, weight=0, n_backends=1)
    other = _target("b", priority=1, weight=10, n_backends=1)
    assert _spread(Balancer(), [fallback, other], 4) == {"a-t0": 4}


@pytest.mark.feature("M12")
def test_several_fallbacks_share_equally() -> None:
    f1 = _target("a", priority=0, weight=0, n_backends=1)
    f2 = _target("b", priority=0, weight=0, n_backends=1)
    assert _spread(Balancer(), [f1, f2], 10) == {"a-t0": 5, "b-t0": 5}


@pytest.mark.feature("M12")
def test_round_robin_over_a_targets_backends() -> None:
    target = _target("a", priority=0, weight=1, n_backends=3)
    balancer = Balancer()
    first = [balancer.choose([target]) for _ in range(3)]
    assert [b.task_id for b in first if b is not None] == ["a-t0", "a-t1", "a-t2"]
    assert _spread(balancer, [target], 300) == {"a-t0": 100, "a-t1": 100, "a-t2": 100}


@pytest.mark.feature("M12")
def test_weights_and_round_robin_combine() -> None:
    big = _target("a", priority=0, weight=2, n_backends=2)
    small = _target("b", priority=0, weight=1, n_backends=1)
    assert _spread(Balancer(), [big, small], 300) == {"a-t0": 100, "a-t1": 100, "b-t0": 100}


@pytest.mark.feature("M12")
def test_shrinking_backend_list_keeps_working() -> None:
    balancer = Balancer()
    _spread(balancer, [_target("a", 0, 1, 3)], 2)
    assert _spread(balancer, [_target("a", 0, 1, 1)], 3) == {"a-t0": 3}


@pytest.mark.feature("M12")
@pytest.mark.parametrize(
    "targets",
    [
        [],
        [_target("a", priority=0, weight=1, n_backends=0)],
        [_target("a", 0, 0, 0), _target("b", 1, 3, 0)],
    ],
)
def test_nothing_routable_gives_none(targets: list[RouteTarget]) -> None:
    assert Balancer().choose(targets) is None


# -- M2: algorithms -------------------------------------------------------------------


def _algo(route_id: str, algorithm: str, n_backends: int, priority: int = 0) -> RouteTarget:
    t = _target(route_id, priority=priority, weight=1, n_backends=n_backends)
    return RouteTarget(t.route_id, t.group_id, t.priority, t.weight, t.backends, algorithm)


@pytest.mark.feature("M2")
def test_random_spreads_over_all_backends() -> None:
    target = _algo("a", "random", 3)
    picks = _spread(Balancer(rng=random.Random(7)), [target], 3000)
    assert set(picks) == {"a-t0", "a-t1", "a-t2"}
    assert all(800 < n < 1200 for n in picks.values())


@pytest.mark.feature("M2")
def test_least_connections_picks_the_least_busy_backend() -> None:
    target = _algo("a", "least_connections", 3)
    b0, b1, b2 = target.backends
    balancer = Balancer()
    for _ in range(3):
        balancer.acquire(b0)
    balancer.acquire(b1)
    assert balancer.choose([target]) == b2
    balancer.acquire(b2)
    balancer.acquire(b2)
    assert balancer.choose([target]) == b1  # b1: 1, b2: 2, b0: 3
    for _ in range(3):
        balancer.release(b0)
    assert balancer.in_flight(b0) == 0
    assert balancer.choose([target]) == b0


@pytest.mark.feature("M2")
def test_least_connections_ties_rotate_and_counters_stay_bounded() -> None:
    target = _algo("a", "least_connections", 3)
    balancer = Balancer()
    assert _spread(balancer, [target], 30) == {"a-t0": 10, "a-t1": 10, "a-t2": 10}
    b0 = target.backends[0]
    balancer.release(b0)  # an unmatched release never goes negative
    assert balancer.in_flight(b0) == 0


@pytest.mark.feature("M2")
def test_least_connections_counts_in_flight_as_the_gateway_would() -> None:
    # Each pick is acquired and held, as the gateway does with open streams.
    target = _algo("a", "least_connections", 2)
    balancer = Balancer()
    held = []
    for _ in range(6):
        b = balancer.choose([target])
        assert b is not None
        balancer.acquire(b)
        held.append(b)
    assert [balancer.in_flight(b) for b in target.backends] == [3, 3]
    balancer.release(held[0])
    assert balancer.choose([target]) == held[0]


@pytest.mark.feature("M2")
def test_engine_aware_falls_back_to_least_connections() -> None:
    target = _algo("a", "engine_aware", 2)
    balancer = Balancer()
    balancer.acquire(target.backends[0])
    assert _spread(balancer, [target], 4) == {"a-t1": 4}


@pytest.mark.feature("M2")
def test_unknown_algorithm_is_round_robin() -> None:
    target = _algo("a", "no-such-thing", 2)
    assert _spread(Balancer(), [target], 4) == {"a-t0": 2, "a-t1": 2}


# -- M5: passive ejection -------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.feature("M5")
def test_ejected_backend_is_skipped_and_restored_after_the_cooldown() -> None:
    clock = _Clock()
    health = PassiveHealth(5.0, clock=clock)
    balancer = Balancer(health)
    target = _target("a", priority=0, weight=1, n_backends=2)
    health.eject(target.backends[0].base_url)
    assert _spread(balancer, [target], 4) == {"a-t1": 4}
    clock.now = 5.0
    assert _spread(balancer, [target], 4) == {"a-t0": 2, "a-t1": 2}


@pytest.mark.feature("M5")
def test_fully_ejected_level_fails_over_to_the_next() -> None:
    health = PassiveHealth(5.0, clock=_Clock())
    primary = _target("a", priority=0, weight=1, n_backends=2)
    secondary = _target("b", priority=1, weight=1, n_backends=1)
    for b in primary.backends:
        health.eject(b.base_url)
    assert _spread(Balancer(health), [primary, secondary], 3) == {"b-t0": 3}


@pytest.mark.feature("M5")
def test_ejected_weighted_target_leaves_its_share_to_the_others() -> None:
    health = PassiveHealth(5.0, clock=_Clock())
    heavy = _target("a", priority=0, weight=3, n_backends=1)
    light = _target("b", priority=0, weight=1, n_backends=1)
    fallback = _target("c", priority=0, weight=0, n_backends=1)
    health.eject(heavy.backends[0].base_url)
    assert _spread(Balancer(health), [heavy, light, fallback], 4) == {"b-t0": 4}
    health.eject(light.backends[0].base_url)
    assert _spread(Balancer(health), [heavy, light, fallback], 2) == {"c-t0": 2}


@pytest.mark.feature("M5")
def test_everything_ejected_fails_open() -> None:
    health = PassiveHealth(5.0, clock=_Clock())
    primary = _target("a", priority=0, weight=1, n_backends=2)
    secondary = _target("b", priority=1, weight=1, n_backends=1)
    for b in (*primary.backends, *secondary.backends):
        health.eject(b.base_url)
    # As if nobody were ejected: the best level, round-robin.
    assert _spread(Balancer(health), [primary, secondary], 4) == {"a-t0": 2, "a-t1": 2}


# -- M4: stickiness -------------------------------------------------------------------


@pytest.mark.feature("M4")
def test_a_session_sticks_to_its_backend() -> None:
    target = _target("a", priority=0, weight=1, n_backends=3)
    balancer = Balancer()
    first = balancer.choose([target], "s1")
    assert all(balancer.choose([target], "s1") == first for _ in range(10))
    # Other sessions and session-less requests still spread.
    others = {balancer.choose([target], f"s{i}") for i in range(2, 8)}
    assert len(others) == 3
    assert balancer.choose([target], "s1") == first


@pytest.mark.feature("M4")
@pytest.mark.feature("M5")
def test_a_session_is_repinned_when_its_backend_is_ejected_or_gone() -> None:
    clock = _Clock()
    health = PassiveHealth(5.0, clock=clock)
    balancer = Balancer(health)
    target = _target("a", priority=0, weight=1, n_backends=2)
    first = balancer.choose([target], "s")
    assert first is not None
    health.eject(first.base_url)
    second = balancer.choose([target], "s")
    assert second is not None and second != first
    clock.now = 10.0  # restored: the session stays where it was re-pinned
    assert balancer.choose([target], "s") == second
    shrunk = RouteTarget("a", "g-a", 0, 1, (first,))
    assert balancer.choose([shrunk], "s") == first
    assert balancer.choose([target], "s") == first


@pytest.mark.feature("M4")
def test_stickiness_does_not_override_failover() -> None:
    balancer = Balancer()
    primary = _target("a", priority=0, weight=1, n_backends=1)
    secondary = _target("b", priority=1, weight=1, n_backends=1)
    empty_primary = _target("a", priority=0, weight=1, n_backends=0)
    assert balancer.choose([empty_primary, secondary], "s") == secondary.backends[0]
    assert balancer.choose([primary, secondary], "s") == primary.backends[0]


@pytest.mark.feature("M4")
def test_session_map_is_a_bounded_lru() -> None:
    target = _target("a", priority=0, weight=1, n_backends=2)
    t0, t1 = target.backends
    balancer = Balancer(max_sessions=2)
    assert balancer.choose([target]) == t0  # no session: round-robin moves on
    assert balancer.choose([target], "s2") == t1
    assert balancer.choose([target], "s1") == t0
    assert balancer.choose([target], "s2") == t1  # pinned; s2 is now the most recent
    assert balancer.choose([target], "s3") == t1  # evicts s1, the least recent
    assert balancer.choose([target], "s1") == t0  # re-pinned by round-robin (evicts s2)
    assert balancer.choose([target], "s3") == t1
