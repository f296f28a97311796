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
from dataclasses import dataclass

from heteroflow.controllers.base import FencedController, Round
from heteroflow.services.lifecycle.scaling import (
    AutoscaleOutcome,
    autoscale_group,
    autoscaled_groups,
    finish_scale_ins,
)
from heteroflow.services.tenancy.usage import prune_load, read_load

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Autoscaler(FencedController[list[AutoscaleOutcome]]):
    """A round answers what was decided for each autoscaled service."""

    name = "autoscaler"
    skipped = "autoscaler"

    min_age_s: float
    load_stale_s: float

    def round(self, r: Round) -> list[AutoscaleOutcome]:
        with self.db.read_snapshot() as s:
            groups = autoscaled_groups(s)
            load = read_load(s, r.now, self.load_stale_s) if groups else None
        out: list[AutoscaleOutcome] = []
        for group_id in groups:
            assert load is not None
            with r.transaction() as s:
                outcome = autoscale_group(
                    s, r.clock, group_id, load, min_age_s=self.min_age_s,
                    stale_s=self.load_stale_s,
                )
            if outcome is None:
                continue
            out.append(outcome)
            if outcome.scaled is not None and outcome.decision is not None:
                log.info("autoscaler: service %s: %s", group_id, outcome.decision.describe())
        return out


@dataclass(eq=False, kw_only=True)
class ScaleDrainer(FencedController[list[str]]):
    """A round answers the leaving replicas it asked to stop."""

    name = "scale-drainer"
    skipped = "scale-in drains"

    drain_timeout_s: float
    load_stale_s: float

    def round(self, r: Round) -> list[str]:
        with r.transaction() as s:
            load = read_load(s, r.now, self.load_stale_s)
            stopped = finish_scale_ins(s, r.clock, load, drain_timeout_s=self.drain_timeout_s)
            prune_load(s, r.now, self.load_stale_s)
        if stopped:
            log.info("scale-in: %d replica(s) drained or timed out, stopping", len(stopped))
        return stopped
