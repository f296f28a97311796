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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from heteroflow.controllers.base import FencedController, Round
from heteroflow.core.recovery import RecoveryPolicy
from heteroflow.services.lifecycle.gangs import recover_gangs
from heteroflow.services.lifecycle.recovery import RecoveryResult, recover

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Recovery(FencedController[RecoveryResult]):
    name = "recovery"
    skipped = "recovery"

    policy: RecoveryPolicy
    offline_after_s: float
    migrate_after_s: float
    # when this instance took the lease it holds (``Leadership.leading_since``): a new
    # leader gives every lost node a whole delay from then
    leading_since: Callable[[datetime], datetime | None]
    # lost nodes whose work waits (logged once per change); the last round that held it
    _held: list[str] = field(default_factory=list, init=False)
    _disrupted_at: datetime | None = field(default=None, init=False)

    def round(self, r: Round) -> RecoveryResult:
        now = r.now
        calm = [t for t in (self.leading_since(now), self._disrupted_at) if t]
        with r.transaction() as s:
            result = recover(
                s,
                r.clock,
                self.policy,
                offline_after_s=self.offline_after_s,
                migrate_after_s=self.migrate_after_s,
                calm_since=max(calm) if calm else None,
            )
            recover_gangs(s, r.clock, self.policy, result)  # issue 32: gangs as one
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
