"""The node watch loop (E2): records nodes lost with live tasks, and their return.

Every interval (the server passes ``scheduler_interval_s``) it runs one round of
``services.faults.watch_nodes``: a node that stopped heartbeating for
``node_offline_after_s`` while it holds starting/running tasks gets one
``fault.node_lost`` per affected group; when it heartbeats again those groups get a
``fault.node_back``. The recorded state lives in the events table — a node's latest
node-level row, found by its ``node_id`` and ``kind`` (``core.events.EventKind``), never
by its message — so a round is idempotent and a restarted server picks up where the
last one stopped.

Leader-only: two instances comparing "recorded" with "heartbeat-derived" state at once
would both write the same fault. Each round's transaction starts with
``fenced(...)`` (services/leadership.py), so a leader paused past its lease writes
nothing once another instance took over.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Protocol

from heteroflow.controllers.base import FrozenClock
from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.services.faults import WatchResult, watch_nodes
from heteroflow.services.leadership import Fence, LeaseLost, fenced

log = logging.getLogger(__name__)


class HoldsLease(Protocol):
    def fence(self, now: datetime) -> Fence | None: ...


class NodeWatch:
    name = "node-watch"
    leader_only = True

    def __init__(
        self,
        db: Database,
        clock: Clock,
        leadership: HoldsLease,
        *,
        interval_s: float,
        offline_after_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.leadership = leadership
        self.interval_s = interval_s
        self.offline_after_s = offline_after_s

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> WatchResult:
        """One round as of ``now`` (default: the clock's); ``LeaseLost`` when this
        instance does not hold the lease, and then nothing is written."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost("this instance does not lead: node watch skipped")
        with self.db.session() as s:
            # first statement of the transaction; the check uses the time it runs at
            fenced(s, fence, self.clock.now())
            return watch_nodes(s, FrozenClock(self.clock, now), self.offline_after_s)
