"""The rollout driver (J1, J2) and the expiry scan (J4).

Every ``rollout_interval_s`` each server instance drives the rollouts it holds (the
instance that answered their ``PUT .../update`` took their execution lease): one step
per rollout, each in its own transaction fenced by that lease (services/lifecycle/rollout.py), so
a rollout whose lease moved on or lapsed is refused and one group's failure does not
stop the others. At its first round and every ``rollout_scan_interval_s`` it also runs
the expiry scan, which fails the rollouts whose holder stopped renewing (it died).

Why every instance and not the leader only: the execution lease already makes each
rollout single-writer (and fences its writes like the leader lease fences the
leader-only loops), the PUT may land on any instance, and a leadership change must not
orphan a rollout that its holder is still driving well. A holder that dies is what the
scan is for.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from heteroflow.controllers.base import FrozenClock
from heteroflow.core.clock import Clock
from heteroflow.core.rollout import RolloutPolicy, Step
from heteroflow.db.engine import Database
from heteroflow.services.lifecycle.rollout import (
    InFlightReader,
    RolloutLeaseLost,
    ScanResult,
    drive_group,
    held_by,
    no_reports,
    scan,
)

log = logging.getLogger(__name__)


class Rollouts:
    name = "rollouts"
    leader_only = False

    def __init__(
        self,
        db: Database,
        clock: Clock,
        holder: str,
        *,
        interval_s: float,
        scan_interval_s: float,
        policy: RolloutPolicy,
        in_flight: InFlightReader = no_reports,
    ) -> None:
        if not 0 < policy.renew_s < policy.lease_ttl_s:
            raise ValueError(
                f"rollout_renew_s ({policy.renew_s}) must be shorter than "
                f"rollout_lease_ttl_s ({policy.lease_ttl_s})"
            )
        self.db = db
        self.clock = clock
        self.holder = holder
        self.interval_s = interval_s
        self.scan_interval_s = scan_interval_s
        self.policy = policy
        self.in_flight = in_flight
        self._next_scan: datetime | None = None  # None: scan at the first round (start)

    def reconcile_once(self, now: datetime) -> None:
        self.drive_round(now)
        if self._next_scan is None or now >= self._next_scan:
            self._next_scan = now + timedelta(seconds=self.scan_interval_s)
            self.scan_round(now)

    def drive_round(self, now: datetime | None = None) -> dict[str, Step]:
        """One step of every rollout this instance holds, as of ``now``."""
        now = now or self.clock.now()
        clock = FrozenClock(self.clock, now)
        with self.db.session() as s:
            groups = held_by(s, self.holder)
        out: dict[str, Step] = {}
        for group_id in groups:
            try:
                with self.db.session() as s:
                    out[group_id] = drive_group(
                        s, clock, group_id, self.holder, self.policy, self.in_flight
                    )
            except RolloutLeaseLost as exc:
                log.warning("rollout of %s not driven: %s", group_id, exc)
            except Exception:
                log.exception("rollout of %s: step failed; retrying next round", group_id)
        return out

    def scan_round(self, now: datetime | None = None) -> ScanResult:
        """Fail the rollouts whose lease lapsed; retire candidates nobody owns."""
        now = now or self.clock.now()
        with self.db.session() as s:
            result = scan(s, FrozenClock(self.clock, now), self.policy)
        if result.failed or result.stopped or result.drained:
            log.info(
                "rollout scan: %d failed (lease lapsed), %d orphaned new replica(s) stopped, "
                "%d drained",
                len(result.failed), len(result.stopped), len(result.drained),
            )
        return result
