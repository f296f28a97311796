"""The wake retrier (F3): acts on wakes that could not happen when they were asked for.

Every ``wake_retry_interval_s`` it runs one ``services.lifecycle.wake_retry.retry_wakes`` round: a
sleeping task with ``wake_requested`` wakes once its node heartbeats again and no
training task holds its cards any more; once its node has had no heartbeat for
``wake_node_lost_after_s`` it is failed with that reason, and the recovery loop rebuilds
it elsewhere (a failed current task of a service meant to run is rebuilt). A ``waking``
task whose node has been gone that long is failed the same way.

Leader-only, fenced like the node watch: two instances would otherwise race the same
compare-and-set (harmless, but double work) and write the same deferral events.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.controllers.base import FencedController, Round
from heteroflow.services.lifecycle.wake_retry import WakeRound, retry_wakes


@dataclass(eq=False, kw_only=True)
class WakeRetrier(FencedController[WakeRound]):
    name = "wake-retrier"
    skipped = "wake retrier"

    offline_after_s: float
    node_lost_after_s: float

    def round(self, r: Round) -> WakeRound:
        with r.transaction() as s:
            return retry_wakes(
                s,
                r.clock,
                offline_after_s=self.offline_after_s,
                node_lost_after_s=self.node_lost_after_s,
            )
