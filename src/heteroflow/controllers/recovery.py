"""The recovery loop (E1-E4, A10): rebuilds failed tasks, moves work off lost nodes and
cards, and stops training / container tasks past their run timeout.

Every ``recovery_interval_s`` it runs one round of ``services.recovery.recover`` (see
there for the steps and ``core.recovery`` for the decisions). Leader-only: two
instances rebuilding the same failed task at once would start it twice (the
compare-and-set on ``replaced_by`` keeps the database right, but the round is also
fenced like every leader-only write, so a leader paused past its lease writes nothing).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Protocol

from heteroflow.controllers.base import FrozenClock
from heteroflow.core.clock import Clock
from heteroflow.core.recovery import RecoveryPolicy
from heteroflow.db.engine import Database
from heteroflow.services.leadership import Fence, LeaseLost, fenced
from heteroflow.services.recovery import RecoveryResult, recover

log = logging.getLogger(__name__)


class HoldsLease(Protocol):
    def fence(self, now: datetime) -> Fence | None: ...

    def leading_since(self, now: datetime) -> datetime | None: ...


class Recovery:
    name = "recovery"
    leader_only = True

    def __init__(
        self,
        db: Database,
        clock: Clock,
        leadership: HoldsLease,
        *,
        interval_s: float,
        policy: RecoveryPolicy,
        offline_after_s: float,
        migrate_after_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.leadership = leadership
        self.interval_s = interval_s
        self.policy = policy
        self.offline_after_s = offline_after_s
        self.migrate_after_s = migrate_after_s
        self._held: list[str] = []  # lost nodes whose work waits (logged once per change)
        self._disrupted_at: datetime | None = None  # the last round that held evacuation

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> RecoveryResult:
        """One round as of ``now`` (default: the clock's); ``LeaseLost`` when this
        instance does not hold the lease, and then nothing is written."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost("this instance does not lead: recovery skipped")
        calm = [t for t in (self.leadership.leading_since(now), self._disrupted_at) if t]
        with self.db.session() as s:
            fenced(s, fence, self.clock.now())
            result = recover(
                s,
                FrozenClock(self.clock, now),
                self.policy,
                offline_after_s=self.offline_after_s,
                migrate_after_s=self.migrate_after_s,
                calm_since=max(calm) if calm else None,
            )
        if result.held:
            self._disrupted_at = now
        if result.held != self._held:
            if result.held:
                log.warning(
                    "recovery: %d node(s) lost at once (%s) and too few heartbeating: taken "
                    "for a control-plane fault (a stalled server, a network split); their "
                    "work is not moved until most nodes are heard from again",
                    len(result.held), ", ".join(result.held[:10]),
                )
            else:
                log.info("recovery: the disruption is over; lost nodes' work moves once "
                         "they stay silent for a whole lost-node delay from now")
            self._held = result.held
        if result.rebuilt or result.gave_up or result.evacuated or result.timed_out:
            log.info(
                "recovery: %d rebuilt, %d given up, %d moved off lost hardware, "
                "%d requeued, %d past their run timeout",
                len(result.rebuilt), len(result.gave_up), len(result.evacuated),
                len(result.requeued), len(result.timed_out),
            )
        return result
