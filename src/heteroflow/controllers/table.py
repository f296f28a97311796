"""The controller table: every loop a server instance runs, built from its settings.

``elect`` makes this instance's elector (a new id at every start); ``build`` makes the
controllers, one row of ``Controllers`` each, in the order ``ServerApp.serve`` starts
them — the elector first, so the leader-only loops skip their rounds until it holds the
lease. A new loop is a field here and a line in ``build``; the server needs no change.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from importlib.metadata import PackageNotFoundError, version

from heteroflow.controllers.autoscaler import Autoscaler, ScaleDrainer
from heteroflow.controllers.base import Controller
from heteroflow.controllers.idle import IdleSleeper
from heteroflow.controllers.leadership import Leadership
from heteroflow.controllers.node_watch import NodeWatch
from heteroflow.controllers.recovery import Recovery
from heteroflow.controllers.rollout import Rollouts
from heteroflow.controllers.scheduler import Scheduler
from heteroflow.controllers.series import SeriesSampler
from heteroflow.controllers.snapshot import SnapshotPublisher
from heteroflow.controllers.wakes import WakeRetrier
from heteroflow.controllers.windows import WindowExecutor
from heteroflow.core.clock import Clock
from heteroflow.core.recovery import RecoveryPolicy
from heteroflow.db.engine import Database
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.services.leadership import DbLeaseStore, InstanceInfo
from heteroflow.services.lifecycle.rollout import gateway_reports
from heteroflow.services.lifecycle.windows import window_scaler
from heteroflow.settings import ServerSettings


def _version() -> str:
    try:
        return version("heteroflow")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return ""


def elect(
    settings: ServerSettings, db: Database, clock: Clock, *, bids: bool = True
) -> Leadership:
    """This instance's elector: its row in server_instances and (``bids``) its bid for
    the lease the leader-only loops run under."""
    instance_id = f"srv-{secrets.token_hex(6)}"
    return Leadership(
        DbLeaseStore(db),
        holder=instance_id,
        ttl_s=settings.leader_lease_ttl_s,
        interval_s=settings.leader_renew_interval_s,
        instance=InstanceInfo(
            id=instance_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=clock.now(),
            version=_version(),
        ),
        bids=bids,
    )


@dataclass(frozen=True)
class Controllers:
    """The table: iterating it gives the controllers in their start order."""

    leadership: Leadership  # every instance
    scheduler: Scheduler  # every instance (SKIP LOCKED keeps their rounds apart)
    node_watch: NodeWatch  # leader-only (E2)
    publisher: SnapshotPublisher  # every instance: each serves its own gateway
    wakes: WakeRetrier  # leader-only (F3)
    recovery: Recovery  # leader-only (E1-E4, A10)
    idle: IdleSleeper  # leader-only (F4)
    autoscaler: Autoscaler  # leader-only (I1)
    scale_drainer: ScaleDrainer  # leader-only (I2)
    windows: WindowExecutor  # leader-only (K1)
    rollouts: Rollouts  # every instance: the rollouts whose lease it took (J1-J4)
    series: SeriesSampler  # leader-only: the live series (issue 33)

    def __iter__(self) -> Iterator[Controller]:
        return (getattr(self, f.name) for f in fields(self))


def build(
    settings: ServerSettings,
    db: Database,
    clock: Clock,
    leadership: Leadership,
    *,
    holder: SnapshotHolder,
    engine_key: Callable[[str], str],
) -> Controllers:
    """The controllers of one instance; ``holder`` is the snapshot its gateway serves
    and ``engine_key`` gives each backend's key (C14)."""
    s, offline = settings, settings.node_offline_after_s
    publisher = SnapshotPublisher(
        db, holder, interval_s=s.snapshot_interval_s, engine_key=engine_key
    )
    return Controllers(
        leadership=leadership,
        scheduler=Scheduler(
            db, clock, interval_s=s.scheduler_interval_s, offline_after_s=offline,
            port_pool=s.port_pool(), reservation=s.reservation(),
            policy=s.placement_policy(), workers=s.scheduler_workers,
        ),
        node_watch=NodeWatch(
            db, clock, leadership, interval_s=s.scheduler_interval_s, offline_after_s=offline
        ),
        publisher=publisher,
        wakes=WakeRetrier(
            db, clock, leadership, interval_s=s.wake_retry_interval_s,
            offline_after_s=offline, node_lost_after_s=s.wake_node_lost_after_s,
        ),
        recovery=Recovery(
            db, clock, leadership, interval_s=s.recovery_interval_s,
            policy=RecoveryPolicy(
                max_rebuilds=s.recovery_max_rebuilds,
                stable_s=s.recovery_stable_s,
                fallback_after=s.recovery_fallback_after,
                disruption_threshold=s.node_disruption_threshold,
            ),
            offline_after_s=offline, migrate_after_s=s.node_migrate_after_s,
            leading_since=leadership.leading_since,
        ),
        idle=IdleSleeper(
            db, clock, leadership, interval_s=s.idle_check_interval_s,
            minute_s=s.idle_minute_s, on_slept=publisher.refresh,
        ),
        autoscaler=Autoscaler(
            db, clock, leadership, interval_s=s.autoscale_interval_s,
            min_age_s=s.autoscale_min_age_s, load_stale_s=s.gateway_load_stale_s,
        ),
        scale_drainer=ScaleDrainer(
            db, clock, leadership, interval_s=s.scale_drain_interval_s,
            drain_timeout_s=s.scale_drain_timeout_s, load_stale_s=s.gateway_load_stale_s,
        ),
        windows=WindowExecutor(
            db, clock, leadership, interval_s=s.schedule_window_interval_s,
            scaler=window_scaler, offline_after_s=offline, on_change=publisher.refresh,
        ),
        rollouts=Rollouts(
            db, clock, leadership.holder, interval_s=s.rollout_interval_s,
            scan_interval_s=s.rollout_scan_interval_s, policy=s.rollout_policy(),
            # drains end when every gateway reports nothing in flight on the replica
            in_flight=gateway_reports(clock, s.gateway_load_stale_s),
        ),
        series=SeriesSampler(
            db, clock, leadership, interval_s=s.series_interval_s,
            load_stale_s=s.gateway_load_stale_s, offline_after_s=offline,
        ),
    )
