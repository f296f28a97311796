"""The idle timer (F4) and the all-in-one gateway's line to the server (F6).

``IdleSleeper`` runs every ``idle_check_interval_s`` on the leader: one read finds the
idle services (``services.idle.idle_groups``: all tasks running, no request and no
(re)start for ``idle_timeout_minutes``), and each is put to sleep in its own fenced
transaction that checks again first (``sleep_if_idle``), so a request reported since
the read keeps it awake and a leader paused past its lease writes nothing.
Leader-only: two instances would both put a service to sleep and write its events twice.

``EmbeddedServerLink`` is what the gateway embedded in ``heteroflow server`` / ``up``
calls when a request names a sleeping model (``gateway.routing.hold.ServerLink``): the wake runs
in a database session in a worker thread, and the snapshot is rebuilt at once (the
gateway also asks for that while it holds requests), so a held request leaves as soon as
the woken task is running. A separate gateway reaches the same service over HTTP
(``POST /api/v1/gateway/wake``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from heteroflow.controllers.base import FencedController, Round
from heteroflow.controllers.snapshot import SnapshotPublisher
from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.schemas.routing import WakeOutcome
from heteroflow.services.lifecycle.idle import (
    MINUTE_S,
    idle_groups,
    sleep_if_idle,
    wake_for_request,
)

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class IdleSleeper(FencedController[dict[str, list[str]]]):
    """A round answers group id -> the task ids it put to sleep."""

    name = "idle-sleep"
    skipped = "idle check"

    minute_s: float = MINUTE_S
    # called after a round put something to sleep (the server: refresh the routing
    # snapshot at once, so its gateway stops routing there before the engine stops)
    on_slept: Callable[[], object] | None = None

    def round(self, r: Round) -> dict[str, list[str]]:
        with self.db.read_snapshot() as s:
            candidates = idle_groups(s, r.now, minute_s=self.minute_s)
        out: dict[str, list[str]] = {}
        for c in candidates:
            with r.transaction() as s:
                slept = sleep_if_idle(s, r.clock, c.group_id, minute_s=self.minute_s)
            if slept:
                out[c.group_id] = slept
                log.info(
                    "service %s: no request for %d min; put to sleep (%s)",
                    c.group_id,
                    c.timeout_minutes,
                    ", ".join(slept),
                )
        if out and self.on_slept is not None:
            self.on_slept()
        return out


class EmbeddedServerLink:
    """``gateway.routing.hold.ServerLink`` in the server's own process: no HTTP, no token."""

    def __init__(
        self,
        db: Database,
        clock: Clock,
        publisher: SnapshotPublisher,
        *,
        offline_after_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.publisher = publisher
        self.offline_after_s = offline_after_s

    async def wake(self, group_ids: Sequence[str], model: str) -> list[WakeOutcome]:
        out = await asyncio.to_thread(self._wake, list(group_ids), model)
        await self.refresh()  # "waking" in the snapshot at once
        return out

    async def refresh(self) -> None:
        await asyncio.to_thread(self.publisher.refresh)

    async def aclose(self) -> None:
        """Nothing to close: the database is the server's."""

    def _wake(self, group_ids: list[str], model: str) -> list[WakeOutcome]:
        with self.db.session() as s:
            return wake_for_request(
                s, self.clock, group_ids, model, offline_after_s=self.offline_after_s
            )
