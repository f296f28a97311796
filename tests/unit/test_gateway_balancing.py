"""The gateway's backend selection policy: priority levels, weights, round-robin."""

from __future__ import annotations

from collections import Counter

import pytest

from heteroflow.gateway.balancing import Balancer
from heteroflow.gateway.snapshot import Backend, RouteTarget


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
