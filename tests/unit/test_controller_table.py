"""The controller table: what a server instance runs, in which order, on which interval,
and that every leader-only round of a follower is refused before it reads anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.controllers.base import FencedController
from heteroflow.controllers.leadership import Leadership
from heteroflow.controllers.table import Controllers, build
from heteroflow.core.clock import FakeClock
from heteroflow.db.engine import Database
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.services.leadership import LeaseLost
from heteroflow.settings import ServerSettings
from heteroflow.testing.fake_leases import InMemoryLeaseStore

LEADER_ONLY = {
    "node-watch", "wake-retrier", "recovery", "idle-sleep", "autoscaler", "scale-drainer",
    "schedule-windows", "series",
}


def _table(tmp_path: Path, clock: FakeClock) -> tuple[Controllers, Leadership]:
    settings = ServerSettings(
        data_dir=tmp_path,
        scheduler_interval_s=1.5,
        snapshot_interval_s=2.5,
        wake_retry_interval_s=3.5,
        recovery_interval_s=4.5,
        idle_check_interval_s=5.5,
        autoscale_interval_s=6.5,
        scale_drain_interval_s=7.5,
        schedule_window_interval_s=8.5,
        rollout_interval_s=9.5,
        series_interval_s=10.5,
    )
    # no schema: any statement a round ran would fail with "no such table"
    db = Database.from_url(f"sqlite:///{tmp_path / 'empty.db'}")
    elector = Leadership(
        InMemoryLeaseStore(), holder="srv-a", ttl_s=settings.leader_lease_ttl_s,
        interval_s=settings.leader_renew_interval_s,
    )
    return build(settings, db, clock, elector, holder=SnapshotHolder(), engine_key=str), elector


def test_the_table_starts_the_elector_first_each_loop_on_its_own_interval(
    tmp_path: Path,
) -> None:
    table, elector = _table(tmp_path, FakeClock())
    rows = list(table)
    assert rows[0] is elector
    assert {c.name: c.interval_s for c in rows} == {
        "leader-election": elector.interval_s,
        "scheduler": 1.5,
        "node-watch": 1.5,  # the node watch follows the scheduler's tick
        "snapshot": 2.5,
        "wake-retrier": 3.5,
        "recovery": 4.5,
        "idle-sleep": 5.5,
        "autoscaler": 6.5,
        "scale-drainer": 7.5,
        "schedule-windows": 8.5,
        "rollouts": 9.5,
        "series": 10.5,
    }
    assert {c.name for c in rows if c.leader_only} == LEADER_ONLY
    # every leader-only loop is fenced the one way, under this instance's elector
    fenced = [c for c in rows if isinstance(c, FencedController)]
    assert {c.name for c in fenced} == LEADER_ONLY
    assert all(c.leadership is elector for c in fenced)


def test_a_followers_leader_only_rounds_are_refused_before_any_read(tmp_path: Path) -> None:
    clock = FakeClock()
    table, elector = _table(tmp_path, clock)
    assert elector.fence(clock.now()) is None  # never took the lease
    for c in table:
        if isinstance(c, FencedController):
            with pytest.raises(LeaseLost, match=f"does not lead: {c.skipped} skipped"):
                c.reconcile_once(clock.now())
