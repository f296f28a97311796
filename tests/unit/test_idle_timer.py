"""F4: the idle timer's rule (fake clock) and the gateway's activity reports.

``services.idle.idle_due`` is the whole rule: the database side only reads its inputs
(tests/integration/test_idle_sleep.py runs it against both databases through the
leader's loop). The collector side: one time per group per flush, the first request
after a quiet spell flushed at once, failures kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.policy.usage import UsageCollector
from heteroflow.schemas.routing import Backend, RouteTarget, RoutingSnapshot
from heteroflow.schemas.usage import UsageRow
from heteroflow.services.lifecycle.idle import idle_due

MINUTE = 60.0


class _Service:
    """A service as the timer sees it, moved by a fake clock."""

    def __init__(self, clock: FakeClock, timeout_minutes: int) -> None:
        self.clock = clock
        self.timeout = timeout_minutes
        self.desired = "running"
        self.statuses: Iterable[str] = ("running",)
        self.last_request: datetime | None = None
        self.running_at: datetime | None = clock.now()  # it just started

    def request(self) -> None:
        self.last_request = self.clock.now()

    def idle(self) -> bool:
        due = idle_due(
            timeout_minutes=self.timeout,
            desired=self.desired,
            statuses=self.statuses,
            last_request_at=self.last_request,
            running_at=self.running_at,
            minute_s=MINUTE,
        )
        return due is not None and self.clock.now() >= due


@pytest.mark.feature("F4")
def test_no_request_puts_it_to_sleep_exactly_after_the_timeout_from_its_start() -> None:
    clock = FakeClock()
    svc = _Service(clock, timeout_minutes=5)
    clock.advance(5 * MINUTE - 1)
    assert not svc.idle()  # a service that never got a request gets its full timeout
    clock.advance(1)
    assert svc.idle()


@pytest.mark.feature("F4")
def test_a_request_resets_the_timer() -> None:
    clock = FakeClock()
    svc = _Service(clock, timeout_minutes=2)
    clock.advance(2 * MINUTE - 10)
    svc.request()
    clock.advance(10)
    assert not svc.idle()  # the timeout counts from the request now
    clock.advance(2 * MINUTE - 11)
    assert not svc.idle()
    clock.advance(1)
    assert svc.idle()


@pytest.mark.feature("F4")
def test_a_wake_restarts_the_timer_even_after_an_old_request() -> None:
    clock = FakeClock()
    svc = _Service(clock, timeout_minutes=1)
    svc.request()
    clock.advance(10 * MINUTE)
    svc.running_at = clock.now()  # it slept and was woken just now
    assert not svc.idle()
    clock.advance(MINUTE)
    assert svc.idle()


@pytest.mark.feature("F4")
def test_timeout_zero_never_sleeps() -> None:
    clock = FakeClock()
    svc = _Service(clock, timeout_minutes=0)
    clock.advance(365 * 24 * 3600)
    assert not svc.idle()


@pytest.mark.parametrize(
    "statuses",
    [
        ("starting",),
        ("waking",),
        ("running", "waking"),
        ("running", "starting"),  # a replica coming up
        ("running", "sleeping"),  # partly asleep already
        ("running", "failed"),
        ("sleeping",),
        (),
    ],
)
@pytest.mark.feature("F4")
def test_only_a_service_whose_tasks_all_run_is_put_to_sleep(statuses: tuple[str, ...]) -> None:
    clock = FakeClock()
    svc = _Service(clock, timeout_minutes=1)
    svc.statuses = statuses
    clock.advance(60 * MINUTE)
    assert not svc.idle()


def test_a_service_its_owner_stopped_is_not_put_to_sleep() -> None:
    clock = FakeClock()
    svc = _Service(clock, timeout_minutes=1)
    svc.desired = "stopped"
    clock.advance(60 * MINUTE)
    assert not svc.idle()


def test_the_minute_is_a_setting() -> None:
    clock = FakeClock()
    start = clock.now()
    due = idle_due(
        timeout_minutes=3,
        desired="running",
        statuses=["running"],
        last_request_at=None,
        running_at=start,
        minute_s=0.5,
    )
    assert due == start + timedelta(seconds=1.5)


# --- the gateway's side: last request times ride on the usage flush ----------------------


class _Sink:
    def __init__(self) -> None:
        self.activity: list[dict[str, datetime]] = []
        self.fail = 0

    async def write(self, rows: Sequence[UsageRow]) -> None:
        pass

    async def write_activity(self, activity: dict[str, datetime]) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError("server away")
        self.activity.append(dict(activity))


class _UsageOnly:
    async def write(self, rows: Sequence[UsageRow]) -> None:
        pass


@pytest.mark.feature("F4")
async def test_one_time_per_group_per_flush_the_latest() -> None:
    clock, sink = FakeClock(), _Sink()
    c = UsageCollector(sink, clock)
    for _ in range(1000):
        c.touch("tg-a")
        clock.advance(0.001)
    c.touch("tg-b")
    last_b = clock.now()
    clock.advance(1)
    c.touch("tg-a")
    assert await c.flush()
    assert sink.activity == [{"tg-a": clock.now(), "tg-b": last_b}]
    assert await c.flush()  # nothing new: no write
    assert len(sink.activity) == 1


async def test_the_first_request_after_a_quiet_spell_is_flushed_at_once() -> None:
    clock, sink = FakeClock(), _Sink()
    c = UsageCollector(sink, clock)
    c.touch("tg-a")
    assert c._full.is_set()  # the flush loop wakes now, not at its next interval
    await c.flush()
    c.touch("tg-a")  # busy: it was in the last flush
    assert not c._full.is_set()
    await c.flush()
    await c.flush()  # a flush without it: quiet for a whole interval
    c.touch("tg-a")
    assert c._full.is_set()


async def test_a_failed_activity_write_is_kept_and_the_newer_time_wins() -> None:
    clock, sink = FakeClock(), _Sink()
    c = UsageCollector(sink, clock)
    c.touch("tg-a")
    first = clock.now()
    sink.fail = 1
    assert not await c.flush()
    assert c.pending_activity == {"tg-a": first}
    clock.advance(3)
    c.touch("tg-a")
    assert await c.flush()
    assert sink.activity == [{"tg-a": clock.now()}]


async def test_a_sink_without_activity_records_none() -> None:
    c = UsageCollector(_UsageOnly(), FakeClock())
    c.touch("tg-a")
    assert c.pending_activity == {}
    assert await c.flush()


def test_the_snapshot_carries_asleep_targets_and_backend_groups_over_the_wire() -> None:
    snap = RoutingSnapshot(
        version=3,
        routes={
            ("t", "m"): (
                RouteTarget("r1", "tg-1", 0, 1, (), asleep="sleeping"),
                RouteTarget(
                    "r2", "tg-2", 0, 1, (Backend("task-1", "http://h:1", group_id="tg-2"),)
                ),
            )
        },
    )
    back = RoutingSnapshot.from_wire(snap.to_wire())
    assert back == snap
    # an older server's snapshot (no such fields) reads as awake, no group
    wire = snap.to_wire()
    for t in wire["routes"][0]["targets"]:
        t.pop("asleep")
        for b in t["backends"]:
            b.pop("group_id")
    old = RoutingSnapshot.from_wire(wire)
    assert [t.asleep for t in old.routes["t", "m"]] == ["", ""]
    assert old.routes["t", "m"][1].backends[0].group_id == ""
