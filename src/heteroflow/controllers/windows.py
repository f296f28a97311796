"""The schedule-window executor (K1): the leader acts on every service's window.

Every ``schedule_window_interval_s`` (60 s) one read finds the groups whose window asks
for something (``services.windows.due_groups``: the window closed with no action in
effect, it opened or was disabled or removed with one in effect, or a pause in effect may
have a replica to put back to sleep); each is then handled in its own fenced transaction
that locks the group row and decides again (``apply_window``), so a change made since the
read (a user stop, a new window) is what counts, and a leader paused past its lease
writes nothing. Leader-only: two instances would both act and write the events twice.

A group that fails is logged and the others go on; the next round tries it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from heteroflow.controllers.base import FrozenClock
from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.services.leadership import Fence, LeaseLost, fenced
from heteroflow.services.sleep import DEFAULT_OFFLINE_AFTER_S
from heteroflow.services.windows import Scaler, WindowOutcome, apply_window, due_groups

log = logging.getLogger(__name__)


class HoldsLease(Protocol):
    def fence(self, now: datetime) -> Fence | None: ...


class WindowExecutor:
    name = "schedule-windows"
    leader_only = True

    def __init__(
        self,
        db: Database,
        clock: Clock,
        leadership: HoldsLease,
        *,
        interval_s: float,
        scaler: Scaler,
        offline_after_s: float = DEFAULT_OFFLINE_AFTER_S,
        on_change: Callable[[], object] | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.leadership = leadership
        self.interval_s = interval_s
        self.scaler = scaler
        self.offline_after_s = offline_after_s
        # called after a round moved tasks (the server: refresh the routing snapshot at
        # once, so the gateway stops routing to a paused service before its engine stops)
        self.on_change = on_change

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> list[WindowOutcome]:
        """One round as of ``now``: what each group's window did. ``LeaseLost`` when
        this instance does not lead (nothing is written then)."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost("this instance does not lead: schedule windows skipped")
        with self.db.read_snapshot() as s:
            due = due_groups(s, now)
        out: list[WindowOutcome] = []
        for group_id in due:
            try:
                with self.db.session() as s:
                    fenced(s, fence, self.clock.now())  # first statement of the transaction
                    done = apply_window(
                        s,
                        FrozenClock(self.clock, now),
                        group_id,
                        scaler=self.scaler,
                        offline_after_s=self.offline_after_s,
                    )
            except LeaseLost:
                raise
            except Exception:
                log.exception("schedule window of group %s failed; retried next round", group_id)
                continue
            if done is not None:
                out.append(done)
                log.info("service %s: %s", group_id, done.message)
        if self.on_change is not None and any(o.moved_tasks for o in out):
            self.on_change()
        return out
