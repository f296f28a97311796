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
from dataclasses import dataclass

from heteroflow.controllers.base import FencedController, Round
from heteroflow.services.leadership import LeaseLost
from heteroflow.services.lifecycle.sleep import DEFAULT_OFFLINE_AFTER_S
from heteroflow.services.lifecycle.windows import Scaler, WindowOutcome, apply_window, due_groups

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class WindowExecutor(FencedController[list[WindowOutcome]]):
    """A round answers what each due group's window did."""

    name = "schedule-windows"
    skipped = "schedule windows"

    scaler: Scaler
    offline_after_s: float = DEFAULT_OFFLINE_AFTER_S
    # called after a round moved tasks (the server: refresh the routing snapshot at
    # once, so the gateway stops routing to a paused service before its engine stops)
    on_change: Callable[[], object] | None = None

    def round(self, r: Round) -> list[WindowOutcome]:
        with self.db.read_snapshot() as s:
            due = due_groups(s, r.now)
        out: list[WindowOutcome] = []
        for group_id in due:
            try:
                with r.transaction() as s:
                    done = apply_window(
                        s, r.clock, group_id, scaler=self.scaler,
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
