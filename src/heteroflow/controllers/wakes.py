"""The wake retrier (F3): acts on wakes that could not happen when they were asked for.

Every ``wake_retry_interval_s`` it runs one ``services.sleep.retry_wakes`` round: a
sleeping task with ``wake_requested`` wakes once its node heartbeats again and no
training task holds its cards any more; once its node has had no heartbeat for
``wake_node_lost_after_s`` it is failed with that reason, and the recovery loop rebuilds
it elsewhere (a failed current task of a service meant to run is rebuilt). A ``waking``
task whose node has been gone that long is failed the same way.

Leader-only, fenced like the node watch: two instances would otherwise race the same
compare-and-set (harmless, but double work) and write the same deferral events.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from heteroflow.controllers.base import FrozenClock
from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.services.leadership import Fence, LeaseLost, fenced
from heteroflow.services.sleep import WakeRound, retry_wakes


class HoldsLease(Protocol):
    def fence(self, now: datetime) -> Fence | None: ...


class WakeRetrier:
    name = "wake-retrier"
    leader_only = True

    def __init__(
        self,
        db: Database,
        clock: Clock,
        leadership: HoldsLease,
        *,
        interval_s: float,
        offline_after_s: float,
        node_lost_after_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.leadership = leadership
        self.interval_s = interval_s
        self.offline_after_s = offline_after_s
        self.node_lost_after_s = node_lost_after_s

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> WakeRound:
        """One round as of ``now`` (default: the clock's); ``LeaseLost`` when this
        instance does not lead, and then nothing is written."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost("this instance does not lead: wake retrier skipped")
        with self.db.session() as s:
            fenced(s, fence, self.clock.now())
            return retry_wakes(
                s,
                FrozenClock(self.clock, now),
                offline_after_s=self.offline_after_s,
                node_lost_after_s=self.node_lost_after_s,
            )
