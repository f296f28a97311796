"""The server's Prometheus series (P3): API latency by route template and status class,
controller rounds and failures, scheduling results, the leader, cached fleet counts."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from heteroflow.controllers.base import run_tick
from heteroflow.controllers.leadership import Leadership
from heteroflow.core.prometheus import Exposition, Histogram, number
from heteroflow.services.leadership import LeaseLost
from heteroflow.services.metrics import FleetCounts, ServerMetrics
from heteroflow.services.placement.scheduling import RoundResult
from heteroflow.testing.fake_leases import InMemoryLeaseStore

NOW = datetime(2025, 1, 1, tzinfo=UTC)
_SAMPLE = re.compile(r'^([a-z_]+(?:\{(?:[a-z_]+="(?:[^"\\]|\\.)*",?)*\})?) (\S+)$')


def samples(body: bytes) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_]+ ", line), line
            continue
        m = _SAMPLE.match(line)
        assert m, line
        out[m[1]] = float(m[2])
    return out


class Mono:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.feature("P3")
def test_api_requests_by_method_route_template_and_status_class() -> None:
    m = ServerMetrics()
    m.api_request("GET", "/api/v1/task-groups/{group_id}", 200, 0.003)
    m.api_request("GET", "/api/v1/task-groups/{group_id}", 204, 0.2)
    m.api_request("POST", "/api/v1/auth/login", 401, 0.04)
    m.api_request("BREW", "other", 404, 0.001)  # a made-up method is no new label value
    s = samples(m.render())
    h = "heteroflow_server_api_request_duration_seconds"
    labels = 'method="GET",route="/api/v1/task-groups/{group_id}",code="2xx"'
    assert s[f"{h}_count{{{labels}}}"] == 2
    assert s[f'{h}_bucket{{{labels},le="0.005"}}'] == 1
    assert s[f'{h}_bucket{{{labels},le="+Inf"}}'] == 2
    assert s[f"{h}_sum{{{labels}}}"] == pytest.approx(0.203)
    assert s[f'{h}_count{{method="POST",route="/api/v1/auth/login",code="4xx"}}'] == 1
    assert s[f'{h}_count{{method="other",route="other",code="4xx"}}'] == 1


@pytest.mark.feature("P3")
def test_scheduling_rounds_add_up() -> None:
    m = ServerMetrics()
    m.scheduler_round(RoundResult(placed=2, unplaced=5, preempted=1, decision_ms=[0.4, 3.0]))
    m.scheduler_round(RoundResult(placed=1, unplaced=3, conflicts=2, decision_ms=[1.5]))
    s = samples(m.render())
    assert s["heteroflow_server_scheduler_placed_total"] == 3
    assert s["heteroflow_server_scheduler_preempted_total"] == 1
    assert s["heteroflow_server_scheduler_conflicts_total"] == 2
    assert s["heteroflow_server_scheduler_waiting_tasks"] == 3  # the latest round's
    d = "heteroflow_server_scheduler_decision_seconds"
    assert s[f'{d}_bucket{{le="0.0005"}}'] == 1
    assert s[f'{d}_bucket{{le="0.002"}}'] == 2
    assert s[f"{d}_count"] == 3


class Flaky:
    name = "flaky"
    leader_only = False
    interval_s = 1.0

    def __init__(self, *errors: Exception | None) -> None:
        self.errors = list(errors)

    def reconcile_once(self, now: datetime) -> None:
        error = self.errors.pop(0)
        if error is not None:
            raise error


class LeaderOnly(Flaky):
    name = "leader-only"
    leader_only = True


@pytest.mark.feature("P3")
def test_controller_rounds_their_time_and_failures_are_counted() -> None:
    m = ServerMetrics()
    follower = Leadership(InMemoryLeaseStore(), holder="b", ttl_s=15, interval_s=5)
    flaky = Flaky(None, RuntimeError("db away"), LeaseLost("lost"))
    for _ in range(3):
        assert run_tick(flaky, follower, NOW, m)
    assert not run_tick(LeaderOnly(None), follower, NOW, m)  # not the leader: no round
    s = samples(m.render())
    assert s['heteroflow_server_controller_rounds_total{controller="flaky"}'] == 3
    assert s['heteroflow_server_controller_round_duration_seconds_count{controller="flaky"}'] == 3
    errors = "heteroflow_server_controller_errors_total"
    assert s[f'{errors}{{controller="flaky",kind="exception"}}'] == 1
    assert s[f'{errors}{{controller="flaky",kind="lease_lost"}}'] == 1
    assert not any("leader-only" in k for k in s)


@pytest.mark.feature("P3")
def test_the_leader_gauge_follows_the_lease() -> None:
    store = InMemoryLeaseStore()
    me = Leadership(store, holder="srv-a", ttl_s=15, interval_s=5)
    m = ServerMetrics(leader=lambda: (me.epoch(NOW), me.holder))
    s = samples(m.render())
    assert s['heteroflow_server_leader{instance="srv-a"}'] == 0
    assert not any(k.startswith("heteroflow_server_leader_epoch") for k in s)
    me.reconcile_once(NOW)
    s = samples(m.render())
    assert s['heteroflow_server_leader{instance="srv-a"}'] == 1
    assert s['heteroflow_server_leader_epoch{instance="srv-a"}'] == 1


@pytest.mark.feature("P3")
def test_fleet_counts_are_read_at_most_every_refresh_interval() -> None:
    reads: list[int] = []

    def fleet() -> FleetCounts:
        reads.append(1)
        return FleetCounts({"online": len(reads), "offline": 0}, {"pending": 2 * len(reads)})

    mono = Mono()
    m = ServerMetrics(fleet=fleet, refresh_s=5.0, monotonic=mono)
    for _ in range(3):  # frequent scrapes: one query
        s = samples(m.render())
    assert len(reads) == 1
    assert s['heteroflow_server_nodes{status="online"}'] == 1
    assert s['heteroflow_server_tasks{status="pending"}'] == 2
    mono.t += 5.0
    s = samples(m.render())
    assert len(reads) == 2 and s['heteroflow_server_nodes{status="online"}'] == 2


def test_a_failed_fleet_read_keeps_the_last_counts() -> None:
    calls: list[int] = []

    def fleet() -> FleetCounts:
        calls.append(1)
        if len(calls) > 1:
            raise OSError("database away")
        return FleetCounts({"online": 4, "offline": 1}, {})

    mono = Mono()
    m = ServerMetrics(fleet=fleet, refresh_s=1.0, monotonic=mono)
    m.render()
    mono.t += 1.0
    assert samples(m.render())['heteroflow_server_nodes{status="online"}'] == 4


def test_exposition_numbers_and_escaping() -> None:
    assert [number(v) for v in (3, 0.5, float("inf"), float("-inf"))] == [
        "3", "0.5", "+Inf", "-Inf",
    ]
    assert number(float("nan")) == "NaN"
    e = Exposition()
    e.family("x_total", "counter", "X.")
    e.sample("x_total", 1, {"path": 'a"b\\c\nd'})
    h = Histogram((1.0,))
    h.observe(2.0)
    e.histogram("y_seconds", h)
    assert e.render().decode().splitlines()[2:] == [
        'x_total{path="a\\"b\\\\c\\nd"} 1',
        'y_seconds_bucket{le="1.0"} 0',
        'y_seconds_bucket{le="+Inf"} 1',
        "y_seconds_sum 2.0",
        "y_seconds_count 1",
    ]


@pytest.mark.feature("P3")
@pytest.mark.feature("P4")
def test_one_process_answers_for_every_process_of_a_server_with_workers() -> None:
    """``server --workers N``: the worker a scrape reaches sums the other processes'
    states — counters and histograms of all (an exited one's too: totals never go down),
    gauges of the live ones (the controllers' process's scheduler and lease)."""
    worker = ServerMetrics(leader=lambda: (None, "srv-w1"))
    worker.api_request("GET", "/healthz", 200, 0.001)
    controllers = ServerMetrics(leader=lambda: (7, "srv-c"))
    controllers.controller_round("scheduler", 0.01)
    controllers.scheduler_round(RoundResult(placed=2, unplaced=3, decision_ms=[4.0]))
    other = ServerMetrics(leader=lambda: (None, "srv-w2"))
    other.api_request("GET", "/healthz", 200, 0.002)
    other.api_request("GET", "/healthz", 500, 0.002)
    gone = ServerMetrics(leader=lambda: (None, "srv-old"))
    gone.api_request("GET", "/healthz", 200, 0.003)
    gone.controller_round("scheduler", 0.02)
    gone.scheduler_round(RoundResult(placed=1, unplaced=9))
    s = samples(
        worker.render(
            [(controllers.state(), True), (other.state(), True), (gone.state(), False)]
        )
    )
    h = 'heteroflow_server_api_request_duration_seconds_count{method="GET",route="/healthz"'
    assert s[f'{h},code="2xx"}}'] == 3 and s[f'{h},code="5xx"}}'] == 1
    assert s['heteroflow_server_controller_rounds_total{controller="scheduler"}'] == 2
    assert s["heteroflow_server_scheduler_placed_total"] == 3
    assert s["heteroflow_server_scheduler_decision_seconds_count"] == 1
    assert s["heteroflow_server_scheduler_waiting_tasks"] == 3  # the live scheduler's
    assert s['heteroflow_server_leader{instance="srv-c"}'] == 1
    assert s['heteroflow_server_leader_epoch{instance="srv-c"}'] == 7
    assert s['heteroflow_server_leader{instance="srv-w2"}'] == 0
    assert not any("srv-old" in k for k in s)
    assert samples(worker.render())[f'{h},code="2xx"}}'] == 1  # alone: its own
