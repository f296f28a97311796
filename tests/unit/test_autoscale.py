"""The autoscaler's rule and the replica bounds (core/autoscale.py), pure, on a fake clock:
the formula, the clamp, metric 0 -> min, the protections on the way down (rank 0, young
replicas, contiguous ranks), the groups it skips, and the load the gateways report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from heteroflow.core.autoscale import (
    MAX_REPLICAS,
    LoadView,
    Replica,
    Sample,
    ScalePolicy,
    create_bounds,
    decide,
    formula,
    group_metric,
    protect,
    scalable_problem,
    skip_reason,
    target_problem,
)
from heteroflow.core.clock import FakeClock
from heteroflow.core.errors import ValidationFailed

INFLIGHT = ScalePolicy(enabled=True, metric="inflight", target=4.0)


def replicas(clock: FakeClock, ages_s: list[float | None]) -> list[Replica]:
    """Rank i running for ages_s[i] seconds (None: never ran, created an hour ago)."""
    now = clock.now()
    out = []
    for rank, age in enumerate(ages_s):
        running_at = None if age is None else now - timedelta(seconds=age)
        out.append(Replica(f"task-{rank}", rank, running_at, now - timedelta(hours=1)))
    return out


@pytest.mark.feature("I1")
@pytest.mark.parametrize(
    ("current", "value", "target", "lo", "expected"),
    [
        (1, 8.0, 4.0, 1, 2),  # twice the target -> twice the replicas
        (2, 4.0, 4.0, 1, 2),  # on target: stay (no float drift past an integer)
        (3, 4.0, 4.0, 1, 3),
        (3, 1.0, 4.0, 1, 1),  # ceil(0.75)
        (3, 0.1, 4.0, 1, 1),
        (4, 5.0, 4.0, 1, 5),  # ceil(5)
        (3, 0.0, 4.0, 2, 2),  # idle -> min_replicas
        (1, 0.0, 4.0, 1, 1),
        (10, 0.3, 0.1, 1, 30),
    ],
)
def test_the_formula_is_proportional_and_idle_means_min(
    current: int, value: float, target: float, lo: int, expected: int
) -> None:
    assert formula(current, value, target, lo) == expected


@pytest.mark.feature("I1")
def test_decide_clamps_to_the_bounds_and_says_why() -> None:
    clock = FakeClock()
    old = replicas(clock, [3600.0])
    up = decide(policy=INFLIGHT, current=1, lo=1, hi=3, value=20.0, replicas=old,
                now=clock.now())
    assert (up.raw, up.desired, up.changes) == (5, 3, True)  # the whole diff at once
    assert up.notes == ("clamped to max_replicas 3",)
    text = up.describe()
    assert "inflight 20.00" in text and "target 4" in text and "= 5" in text
    assert "clamped to max_replicas 3" in text and "scale 1 → 3" in text

    three = replicas(clock, [3600.0, 3600.0, 3600.0])
    idle = decide(policy=INFLIGHT, current=3, lo=2, hi=3, value=0.0, replicas=three,
                  now=clock.now())
    assert (idle.raw, idle.desired) == (2, 2)  # metric 0 -> min_replicas
    assert "idle, min_replicas 2" in idle.describe() and "scale 3 → 2" in idle.describe()

    low = decide(policy=INFLIGHT, current=3, lo=2, hi=5, value=1.0, replicas=three,
                 now=clock.now())
    assert (low.raw, low.desired, low.notes) == (1, 2, ("clamped to min_replicas 2",))

    steady = decide(policy=INFLIGHT, current=2, lo=1, hi=3, value=4.0,
                    replicas=replicas(clock, [3600.0, 3600.0]), now=clock.now())
    assert (steady.desired, steady.changes) == (2, False)
    assert "stay 2 → 2" in steady.describe()


@pytest.mark.feature("I1")
def test_a_replica_younger_than_60_s_is_not_scaled_down_nor_is_rank_0() -> None:
    clock = FakeClock()
    # rank 2 has run 30 s: scaling 3 -> 1 stops above it (ranks stay contiguous)
    group = replicas(clock, [3600.0, 3600.0, 30.0])
    d = decide(policy=INFLIGHT, current=3, lo=1, hi=3, value=0.0, replicas=group,
               now=clock.now())
    assert (d.raw, d.desired, d.changes) == (1, 3, False)
    assert "held at 3: rank 2 (task-2) running 30 s ago, younger than 60 s" in d.describe()

    # rank 1 young, rank 2 old: rank 2 may go, rank 1 stays (and rank 0 with it)
    group = replicas(clock, [3600.0, 10.0, 3600.0])
    d = decide(policy=INFLIGHT, current=3, lo=1, hi=3, value=0.0, replicas=group,
               now=clock.now())
    assert d.desired == 2 and "rank 1" in d.notes[0]

    # 60 s later every replica may go but rank 0
    clock.advance(61)
    group = replicas(clock, [3600.0, 61.0, 61.0])
    d = decide(policy=INFLIGHT, current=3, lo=1, hi=3, value=0.0, replicas=group,
               now=clock.now())
    assert (d.desired, d.notes) == (1, ())

    # a replica that never ran counts from its creation
    now = clock.now()
    fresh = [Replica("task-0", 0, now - timedelta(hours=1), now - timedelta(hours=1)),
             Replica("task-1", 1, None, now - timedelta(seconds=5))]
    floor, why = protect(1, fresh, now, 60.0)
    assert floor == 2 and "created 5 s ago" in why

    # rank 0 is never scaled away, whatever the formula says
    assert protect(0, replicas(clock, [3600.0]), clock.now(), 60.0) == (1, "")
    # the protection has a setting (tests shorten it)
    young = replicas(clock, [3600.0, 5.0])
    assert protect(1, young, clock.now(), 1.0) == (1, "")


@pytest.mark.feature("I1")
def test_no_data_decides_nothing() -> None:
    clock = FakeClock()
    d = decide(policy=INFLIGHT, current=2, lo=1, hi=3, value=None,
               replicas=replicas(clock, [3600.0, 3600.0]), now=clock.now(),
               no_data="no gateway reported its load in the last 20 s")
    assert (d.desired, d.changes) == (2, False)
    assert d.describe() == "no decision: no gateway reported its load in the last 20 s"


@pytest.mark.feature("I1")
def test_the_autoscaler_skips_a_group_outside_its_window_updating_stopped_or_asleep() -> None:
    ok = {"desired_state": "running", "window_action": "", "rollout_holder": ""}
    assert skip_reason(**ok, task_statuses=["running", "pending"]) is None
    window = skip_reason(**{**ok, "window_action": "scale"}, task_statuses=["running"])
    assert window is not None and window[0] == "window" and "'scale'" in window[1]
    rollout = skip_reason(**{**ok, "rollout_holder": "srv-1"}, task_statuses=["running"])
    assert rollout is not None and rollout[0] == "rollout"
    stopped = skip_reason(**{**ok, "desired_state": "stopped"}, task_statuses=["stopped"])
    assert stopped is not None and stopped[0] == "stopped"
    asleep = skip_reason(**ok, task_statuses=["sleeping"])
    assert asleep is not None and asleep[0] == "asleep"
    assert skip_reason(**ok, task_statuses=["running", "waking"]) is not None


@pytest.mark.feature("I1")
def test_each_metric_from_the_gateways_reports() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    load = LoadView(
        gateways=2,
        as_of=at,
        samples={
            # two gateways route to t0; the engine's own figures are the same engine's
            "t0": (Sample(3, 10.0, 2.0, 0.5, False), Sample(1, 5.0, 3.0, 0.7, False)),
            "t1": (Sample(2, 1.0, None, None, False),),
            "gone": (Sample(9, 99.0, 9.0, 0.9, False),),  # not a current replica
        },
    )
    ids = ["t0", "t1", "t2"]  # t2: not routable yet (no report lists it)
    assert group_metric("inflight", load, ids, 3) == pytest.approx(6 / 3)
    assert group_metric("tokens_per_s", load, ids, 3) == pytest.approx(16 / 3)
    assert group_metric("queue", load, ids, 3) == pytest.approx(3.0 / 3)  # max per engine
    assert group_metric("kv_cache", load, ids, 3) == pytest.approx(70.0)  # mean of known, %
    # engines that export nothing: no data, not zero
    assert group_metric("queue", load, ["t1"], 1) is None
    assert group_metric("kv_cache", load, ["t1"], 1) is None
    # no gateway at all: no data for any metric
    for metric in ("inflight", "tokens_per_s", "queue", "kv_cache"):
        assert group_metric(metric, LoadView(), ids, 3) is None
    # a gateway that reports and routes nothing to the group: idle, not unknown
    assert group_metric("inflight", LoadView(gateways=1, as_of=at), ids, 3) == 0.0
    assert load.in_flight_of(["t0", "t2"]) == {"t0": (4, at), "t2": (0, at)}
    assert LoadView().in_flight_of(["t0"]) == {}


@pytest.mark.feature("I2")
def test_drained_means_every_gateway_routing_to_it_knows_and_has_nothing_in_flight() -> None:
    load = LoadView(
        gateways=2,
        as_of=datetime(2026, 1, 1, tzinfo=UTC),
        samples={
            "busy": (Sample(in_flight=1, draining=True), Sample(in_flight=0, draining=True)),
            "late": (Sample(in_flight=0, draining=True), Sample(in_flight=0, draining=False)),
            "done": (Sample(in_flight=0, draining=True),),
        },
    )
    assert not load.drained("busy")
    assert not load.drained("late")  # a gateway whose snapshot does not say so yet
    assert load.drained("done")
    assert load.drained("unlisted")  # no gateway routes to it: nothing can be in flight


@pytest.mark.feature("A1")
def test_bounds_at_create_name_the_field() -> None:
    assert create_bounds(replicas=1, task_type="inference", parallelism="single",
                         min_replicas=None, max_replicas=3) == (1, 3)
    assert create_bounds(replicas=2, task_type="inference", parallelism="split",
                         min_replicas=None, max_replicas=None) == (2, 2)
    assert create_bounds(replicas=2, task_type="training", parallelism="split",
                         min_replicas=2, max_replicas=2) == (2, 2)  # equal: harmless
    cases: list[tuple[dict[str, int | None], str, str]] = [
        ({"min_replicas": 2, "max_replicas": None}, "min_replicas", "above the group's 1"),
        ({"min_replicas": 1, "max_replicas": MAX_REPLICAS + 1}, "max_replicas", "1-64"),
        ({"min_replicas": 0, "max_replicas": 2}, "min_replicas", "1-64"),
    ]
    for given, field, text in cases:
        with pytest.raises(ValidationFailed) as exc:
            create_bounds(
                replicas=1, task_type="inference", parallelism="single",
                min_replicas=given["min_replicas"], max_replicas=given["max_replicas"],
            )
        assert exc.value.field == field and text in exc.value.message
    with pytest.raises(ValidationFailed) as exc:
        create_bounds(replicas=2, task_type="training", parallelism="split",
                      min_replicas=None, max_replicas=4, prefix="scale_policy.")
    assert exc.value.field == "scale_policy.max_replicas"
    assert "only inference services scale" in exc.value.message
    with pytest.raises(ValidationFailed) as exc:
        create_bounds(replicas=2, task_type="inference", parallelism="pipeline",
                      min_replicas=None, max_replicas=4)
    assert "cannot scale" in exc.value.message
    assert scalable_problem("inference", "tensor_parallel") is None
    assert target_problem("kv_cache", 120) is not None
    assert target_problem("queue", 120) is None


@pytest.mark.feature("I1")
def test_a_stored_policy_reads_back_and_junk_reads_as_off() -> None:
    p = ScalePolicy(True, "tokens_per_s", 50.0)
    assert ScalePolicy.from_json(p.to_json()) == p
    assert not ScalePolicy.from_json({}).enabled
    assert not ScalePolicy.from_json(None).enabled
    assert not ScalePolicy.from_json({"enabled": True, "metric": "cpu", "target": 1}).enabled
    assert not ScalePolicy.from_json({"enabled": True, "metric": "queue", "target": 0}).enabled
    assert not ScalePolicy.from_json({"enabled": "yes", "metric": "queue", "target": 2}).enabled
    assert "tokens/s per replica" in p.describe()
