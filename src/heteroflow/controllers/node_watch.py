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

from dataclasses import dataclass

from heteroflow.controllers.base import FencedController, Round
from heteroflow.services.lifecycle.faults import WatchResult, watch_nodes


@dataclass(eq=False, kw_only=True)
class NodeWatch(FencedController[WatchResult]):
    name = "node-watch"
    skipped = "node watch"

    offline_after_s: float

    def round(self, r: Round) -> WatchResult:
        with r.transaction() as s:
            return watch_nodes(s, r.clock, self.offline_after_s)
