"""The autoscaler (I1) and the end of scale-ins (I2), both leader-only and fenced.

``Autoscaler`` runs every ``autoscale_interval_s`` (30 s): one read of the gateways'
load reports (``services.usage.read_load``) and of the services whose scale policy is
enabled, then each service in its own fenced transaction (``services.scaling
.autoscale_group``: it reads the group again there, so a stop, an update or a window
that began since the read wins).

``ScaleDrainer`` runs every ``scale_drain_interval_s`` (1 s): the replicas a scale-in
took away are stopped once the gateways report them drained, or past
``scale_drain_timeout_s`` (``services.scaling.finish_scale_ins``); it also deletes the
load reports of gateways long gone.

Leader-only: two instances would decide twice on the same figures and write every
decision twice; a leader paused past its lease writes nothing (``fenced``).
"""

from __future__ import annotations

import logging
from datetime import datetime

from heteroflow.controllers.base import FrozenClock
from heteroflow.controllers.node_watch import HoldsLease
from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.services.leadership import LeaseLost, fenced
from heteroflow.services.scaling import (
    AutoscaleOutcome,
    autoscale_group,
    autoscaled_groups,
    finish_scale_ins,
)
from heteroflow.services.usage import prune_load, read_load

log = logging.getLogger(__name__)


class Autoscaler:
    name = "autoscaler"
    leader_only = True

    def __init__(
        self,
        db: Database,
        clock: Clock,
        leadership: HoldsLease,
        *,
        interval_s: float,
        min_age_s: float,
        load_stale_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.leadership = leadership
        self.interval_s = interval_s
        self.min_age_s = min_age_s
        self.load_stale_s = load_stale_s

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> list[AutoscaleOutcome]:
        """One round as of ``now``: what was decided for each autoscaled service.
        ``LeaseLost`` when this instance does not lead (nothing is written then)."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost("this instance does not lead: autoscaler skipped")
        with self.db.read_snapshot() as s:
            groups = autoscaled_groups(s)
            load = read_load(s, now, self.load_stale_s) if groups else None
        out: list[AutoscaleOutcome] = []
        for group_id in groups:
            assert load is not None
            with self.db.session() as s:
                fenced(s, fence, self.clock.now())  # first statement of the transaction
                outcome = autoscale_group(
                    s,
                    FrozenClock(self.clock, now),
                    group_id,
                    load,
                    min_age_s=self.min_age_s,
                    stale_s=self.load_stale_s,
                )
            if outcome is None:
                continue
            out.append(outcome)
            if outcome.scaled is not None and outcome.decision is not None:
                log.info("autoscaler: service %s: %s", group_id, outcome.decision.describe())
        return out


class ScaleDrainer:
    name = "scale-drainer"
    leader_only = True

    def __init__(
        self,
        db: Database,
        clock: Clock,
        leadership: HoldsLease,
        *,
        interval_s: float,
        drain_timeout_s: float,
        load_stale_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.leadership = leadership
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        self.load_stale_s = load_stale_s

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> list[str]:
        """One round as of ``now``: the leaving replicas asked to stop."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost("this instance does not lead: scale-in drains skipped")
        with self.db.session() as s:
            fenced(s, fence, self.clock.now())
            load = read_load(s, now, self.load_stale_s)
            stopped = finish_scale_ins(
                s, FrozenClock(self.clock, now), load, drain_timeout_s=self.drain_timeout_s
            )
            prune_load(s, now, self.load_stale_s)
        if stopped:
            log.info("scale-in: %d replica(s) drained or timed out, stopping", len(stopped))
        return stopped
