"""Starting engines: claim a scheduled task and launch it, adopt one that outlived the
agent (C2), and a launch whose port is taken (P2: back to the server, or retried with
back-off).
"""

from __future__ import annotations

import asyncio
import logging

from heteroflow.agent.client import ServerError
from heteroflow.agent.fetching import fetch_model, needs_fetch
from heteroflow.agent.launch import host_port_for
from heteroflow.agent.loading import Loading
from heteroflow.agent.pulling import PullsImages, pull_image
from heteroflow.agent.runtime.protocol import LaunchFailed, PortInUse, PullFailed
from heteroflow.agent.state import Local, Retry
from heteroflow.core.health import HealthCheckConfig, HealthTracker
from heteroflow.core.images import PERMANENT
from heteroflow.core.ports import ports_from_dicts
from heteroflow.schemas.nodes import TaskAssignment

log = logging.getLogger(__name__)


class Starting(Loading):
    """The agent's part that starts engines."""

    def _adopt(self, t: TaskAssignment) -> Local:
        health = HealthCheckConfig.from_api(t.health_check)
        tracker = HealthTracker(health, started_at=self.clock.monotonic())
        loc = Local(
            task=t,
            tracker=tracker,
            health=health,
            port=host_port_for(t, health.port),
            reported_running=t.status == "running",
        )
        self.local[t.id] = loc
        log.info("adopted running %s %s", self.runtime.name, t.id)
        return loc

    async def _claim_and_start(self, t: TaskAssignment) -> None:
        try:
            t = await self.client.claim(t.id)
        except ServerError as exc:
            log.info("claim of %s refused: %s", t.id, exc)
            return
        await self._free_cards(t)
        first = self.clock.monotonic()
        # H7: its pull may take minutes; issue 29: its model's download too
        if isinstance(self.launcher, PullsImages) or needs_fetch(t):
            self.launching[t.id] = asyncio.create_task(self._launch_beside(t, first))
            return
        await self._launch(t, attempt=1, first_try=first)

    async def _free_cards(self, t: TaskAssignment) -> None:
        """F5: an engine kept asleep on a card this task is placed on (training borrowing
        a sleeping service's card) is stopped first, so that the card is really free; its
        wake then starts it again."""
        cards = set(t.gpu_ids)
        for task_id, loc in self.asleep.items():
            if loc.kept and cards & set(loc.task.gpu_ids):
                self.stopping.add(task_id)
                try:
                    await asyncio.to_thread(
                        self.runtime.halt, task_id, self.settings.stop_timeout_s
                    )
                except Exception:  # the launch goes on; the card may still be short
                    log.exception("could not stop the sleeping engine of %s", task_id)
                    continue
                finally:
                    self.stopping.discard(task_id)
                loc.kept = False
                log.info("task %s: its sleeping engine stopped to free its card(s) for %s",
                         task_id, t.id)

    async def _launch_beside(self, t: TaskAssignment, first_try: float) -> None:
        """A launch run beside the heartbeat (H7): two launches of one image started in
        one convergence wait on one pull, and the node keeps beating meanwhile."""
        try:
            await self._launch(t, attempt=1, first_try=first_try)
        except Exception:
            log.exception("launch of %s failed", t.id)
        finally:
            self.launching.pop(t.id, None)

    async def _launch(self, t: TaskAssignment, *, attempt: int, first_try: float) -> None:
        self.retry.pop(t.id, None)
        try:
            health = HealthCheckConfig.from_api(t.health_check)
            port = host_port_for(t, health.port)
            t = await fetch_model(self, t)  # issue 29: a model source comes to the node first
            if self.launcher.runtime.name == "process":
                # in the loop's own thread: a child's death signal follows its parent thread
                argv = self.launcher.launch(t)
            else:
                await pull_image(self, t)  # H7: the image first, when absent
                argv = await asyncio.to_thread(self.launcher.launch, t)
        except PortInUse as exc:
            self.metrics.launched("port_busy")
            await self._port_taken(t, exc, attempt, first_try)
            return
        except PullFailed as exc:
            self.metrics.launched("failed")
            fault = "image_unavailable" if exc.kind in PERMANENT else None
            await self._report(t.id, "failed", str(exc), fault=fault)
            return
        except (LaunchFailed, ValueError) as exc:
            self.metrics.launched("failed")
            await self._report(t.id, "failed", f"launch failed: {exc}")
            return
        self.metrics.launched("started")
        tracker = HealthTracker(health, started_at=self.clock.monotonic())
        loc = Local(task=t, tracker=tracker, health=health, port=port, argv=argv)
        self.local[t.id] = loc
        await self._open_load(loc, wake=False)  # D5: its window follows its load

    async def _port_taken(
        self, t: TaskAssignment, exc: PortInUse, attempt: int, first_try: float
    ) -> None:
        """P2. A port the pool chose, held by something this agent did not just stop,
        goes back to the server at once: it places the task again with another port and
        skips this one here. A fixed port, or one an engine this agent stopped may still
        be leaving (C11), is retried with back-off; every retry is noted on the task."""
        now = self.clock.monotonic()
        for port, at in list(self.released.items()):
            if now - at > self.backoff.total_s:
                del self.released[port]
        pool = {p.host_port for p in ports_from_dicts(t.ports) if p.from_pool}
        strangers = tuple(p for p in exc.ports if p in pool and p not in self.released)
        if strangers:
            log.info("%s: %s; the server places it again", t.id, exc)
            await self._report(t.id, "pending", str(exc), busy_ports=strangers)
            return
        delay = self.backoff.next_delay(attempt, now - first_try)
        if delay is None:
            elapsed = now - first_try
            why = f"launch failed: {exc} (still after {elapsed:.0f} s)"
            await self._report(t.id, "failed", why)
            return
        why = f"{exc}; launch retry {attempt} in {delay:.0f} s"
        log.info("%s: %s", t.id, why)
        self.retry[t.id] = Retry(t, now + delay, attempt + 1, first_try)
        await self._report(t.id, "starting", why)

