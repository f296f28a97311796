"""The gateway's side of the autoscaler's figures (issue 14): the load report every usage
flush carries — in flight and draining per backend from the balancer and the snapshot,
tokens/s over the last 30 s, the engines' queue and KV use from the load scrapes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.backend.engine_metrics import EngineLoad
from heteroflow.gateway.policy.usage import TOKEN_WINDOW_S, UsageCollector
from heteroflow.schemas.routing import Backend, RouteTarget, RoutingSnapshot, SnapshotHolder
from heteroflow.schemas.usage import (
    ActivityReport,
    BackendLoad,
    GatewayLoad,
    UsageRow,
    activity_report_to_wire,
)


class _ReportSink:
    def __init__(self) -> None:
        self.reports: list[tuple[dict[str, datetime], GatewayLoad]] = []
        self.activity: list[dict[str, datetime]] = []
        self.fail = 0

    async def write(self, rows: Sequence[UsageRow]) -> None:
        pass

    async def write_activity(self, activity: dict[str, datetime]) -> None:
        self.activity.append(dict(activity))

    async def write_report(self, activity: dict[str, datetime], load: GatewayLoad) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError("server away")
        self.reports.append((dict(activity), load))


def _load(task_id: str = "task-1") -> GatewayLoad:
    return GatewayLoad("gw-test", (BackendLoad(task_id, "tg-1", False, 2, 0.0),))


@pytest.mark.feature("I1")
async def test_every_flush_carries_the_load_with_the_activity_and_a_failure_keeps_the_times(
) -> None:
    clock, sink = FakeClock(), _ReportSink()
    c = UsageCollector(sink, clock)
    assert await c.flush()
    assert sink.reports == []  # no load source yet: nothing to say
    c.set_load_source(_load)
    assert await c.flush()  # nothing happened: the load still goes (it is a state)
    assert sink.reports == [({}, _load())]
    c.touch("tg-1")
    sink.fail = 1
    assert not await c.flush()
    assert c.pending_activity  # the times are kept; the load is not (the next is newer)
    assert await c.flush()
    assert sink.reports[-1][0] == {"tg-1": clock.now()} and sink.activity == []


@pytest.mark.feature("I1")
async def test_tokens_per_second_per_backend_over_the_last_30_s() -> None:
    clock, sink = FakeClock(), _ReportSink()
    c = UsageCollector(sink, clock)
    c.set_load_source(_load)
    c.backend_tokens("task-1", 100)
    c.backend_tokens("task-1", 50)
    c.backend_tokens("task-2", 0)  # nothing answered: no entry
    clock.advance(5)
    await c.flush()
    assert c.token_rates == {"task-1": pytest.approx(150 / 5)}
    for _ in range(6):  # 30 s more at 10 tokens/s
        c.backend_tokens("task-1", 50)
        clock.advance(5)
        await c.flush()
    assert c.token_rates["task-1"] == pytest.approx(300 / TOKEN_WINDOW_S)
    clock.advance(TOKEN_WINDOW_S)
    await c.flush()
    assert c.token_rates == {}  # quiet for the whole window


@pytest.mark.feature("I1", "I2")
def test_the_report_lists_every_backend_of_the_snapshot_as_this_gateway_sees_it() -> None:
    a = Backend("task-a", "http://h:1", group_id="tg-1")
    b = Backend("task-b", "http://h:2", group_id="tg-1", draining=True)
    external = Backend("ext", "http://h:3")  # a routes file's backend: no group
    snap = RoutingSnapshot(
        version=1,
        routes={
            ("tn", "chat"): (RouteTarget("r-1", "tg-1", 0, 100, (a, b)),),
            ("tn", "alias"): (RouteTarget("r-2", "tg-1", 0, 100, (a, external)),),
        },
    )
    clock = FakeClock()
    collector = UsageCollector(_ReportSink(), clock)
    app = GatewayApp(SnapshotHolder(snap), usage=collector, clock=clock)
    app._balancer.acquire(a)
    app._balancer.acquire(a)
    app._balancer.acquire(b)
    app._monitor._report_loads["http://h:2"] = EngineLoad(1.0, 3.0, 0.5)
    collector.backend_tokens("task-a", 60)
    clock.advance(30)
    collector.roll_tokens()
    load = app.load_report()
    assert load.gateway_id == app.gateway_id and load.gateway_id.startswith("gw-")
    a_load, b_load = load.backends
    assert a_load.tokens_per_s == pytest.approx(2.0)  # 60 tokens over 30 s
    assert a_load == BackendLoad("task-a", "tg-1", False, 2, a_load.tokens_per_s, None, None)
    assert b_load == BackendLoad("task-b", "tg-1", True, 1, 0.0, 3.0, 0.5)
    # what a separate gateway posts is what the server's route reads
    wire = activity_report_to_wire({}, load)
    parsed = ActivityReport.model_validate(wire)
    assert parsed.load is not None and parsed.load.to_load() == load
