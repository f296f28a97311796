"""The node watch loop (E2): records nodes lost with live tasks, and their return.

Every interval (the server passes ``scheduler_interval_s``) it runs one round of
``services.faults.watch_nodes``: a node that stopped heartbeating for
``node_offline_after_s`` while it holds starting/running tasks gets one
``fault.node_lost`` per affected group; when it heartbeats again those groups get a
``fault.node_back``. The recorded state lives in the events table, so a round is
idempotent and a restarted server picks up where the last one stopped.
"""

from __future__ import annotations

import logging

from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.services.faults import WatchResult, watch_nodes

log = logging.getLogger(__name__)


class NodeWatch:
    name = "node-watch"

    def __init__(
        self, db: Database, clock: Clock, *, interval_s: float, offline_after_s: float
    ) -> None:
        self.db = db
        self.clock = clock
        self.interval_s = interval_s
        self.offline_after_s = offline_after_s

    def reconcile_once(self) -> None:
        self.run_round()

    def run_round(self) -> WatchResult:
        with self.db.session() as s:
            return watch_nodes(s, self.clock, self.offline_after_s)
