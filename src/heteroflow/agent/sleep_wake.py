"""Sleep and wake (F1, F2, D2) on the node.

Sleep and wake (F1, F2, D2). A task listed ``sleeping`` whose engine runs here is put to
sleep: a vLLM-family engine first gets ``POST /sleep?level=2`` (skipped when it lacks
it), then the engine is stopped — the container is kept (Docker), a process is simply
gone — and its health checks pause with their counter reset. Nothing is reported: the
task is already sleeping, and a sleeping task with no engine is normal (never "lost"),
its kept container is no zombie. A task listed ``waking`` resumes (C2's resume branch):
the same container starts again (gone: the task fails with ``container_lost``, F3), or
the same argv is launched again; it is watched like any engine, with a fresh start
period and a load window that follows its load (D5: no fixed limit; stopped once its
load stalls), and reported ``running`` at its first passing health check. Between
heartbeats a light poll
(``task_life_poll_interval_s``) asks the server which tasks sleep or wake, so both reach
the engine within a fraction of a second rather than at the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from heteroflow.agent.launch import host_port_for
from heteroflow.agent.loading import Loading
from heteroflow.agent.runtime.protocol import ContainerGone, LaunchFailed, PortInUse
from heteroflow.core.clock import interruptible_sleep
from heteroflow.core.containers import VLLM_FAMILY
from heteroflow.core.health import HealthCheckConfig
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.schemas.sleep import NodeTaskLife

log = logging.getLogger(__name__)


class SleepWake(Loading):
    """The agent's part that puts engines to sleep and wakes them."""

    async def _to_sleep(self, t: TaskAssignment, managed: dict[str, str]) -> None:
        """F1: stop the engine of a task listed sleeping, if it still runs here."""
        # Out of `local` first: the watcher must not take the exit we cause for a crash.
        loc = self.local.pop(t.id, None)
        engine_up = loc is not None or managed.get(t.id) == "running"
        if loc is None:
            loc = self.asleep.get(t.id) or self._local_for(t)  # after an agent restart
        loc.task = t
        loc.tracker.pause()  # D2: no probes while asleep; the failure counter reset
        loc.waking = False
        loc.reported_running = False
        loc.load = None  # D5: no load window while asleep
        self.asleep[t.id] = loc
        if not engine_up:
            return
        self.stopping.add(t.id)
        start = self.clock.monotonic()
        try:
            how = await self._engine_sleep(t) if t.engine in VLLM_FAMILY else ""
            try:  # its last output first; a shipping error must never block the sleep
                await self.shipper.ship_once([t.id])
            except Exception:
                log.exception("last log round of %s failed", t.id)
            await asyncio.to_thread(self.runtime.halt, t.id, self.settings.stop_timeout_s)
        except Exception:  # the engine may still run: the next look tries again
            log.exception("could not put the engine of %s to sleep; retrying", t.id)
            return
        finally:
            self.stopping.discard(t.id)
        kept = "container kept" if self.runtime.name == "docker" else "process stopped"
        log.info(
            "task %s asleep: engine stopped in %.1f s (%s)%s",
            t.id, self.clock.monotonic() - start, kept, f"; {how}" if how else "",
        )

    async def _engine_sleep(self, t: TaskAssignment) -> str:
        """vLLM's ``POST /sleep?level=2`` before the stop (F1); what happened, in words.
        An engine without it (sleep mode off: 404) or not answering is skipped."""
        try:
            port = host_port_for(t)
        except LaunchFailed:
            return "no engine port: /sleep skipped"
        # the engine itself, over the loopback: its door never lets /sleep through (C14)
        url = f"http://{self.launcher.probe_host_for(t, port)}:{port}/sleep?level=2"
        timeout = aiohttp.ClientTimeout(total=self.settings.vllm_sleep_timeout_s)
        auth = {"Authorization": f"Bearer {t.engine_key}"}
        try:
            async with self._session().post(url, timeout=timeout, headers=auth) as r:
                if r.status < 300:
                    return "vLLM sleep level 2 done"
                return f"/sleep answered HTTP {r.status} (sleep mode off?): skipped"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return f"/sleep not answered ({type(exc).__name__}): skipped"

    async def _wake(self, t: TaskAssignment) -> None:
        """F2, C2's resume branch: start the engine of a task listed waking again."""
        now = self.clock.monotonic()
        loc = self.local.get(t.id)
        if loc is not None:
            # its engine is up: a wake under way, or a sleep and a wake between two looks
            loc.task = t
            if not loc.waking:
                loc.tracker.resume(now)  # probed at once, reported running when it passes
                loc.waking, loc.woken_at = True, now
                loc.reported_running = False
                await self._open_load(loc, wake=True)
            return
        loc = self.asleep.pop(t.id, None) or self._local_for(t)
        try:
            health = HealthCheckConfig.from_api(t.health_check)  # D4: maybe changed
            loc.task, loc.health, loc.port = t, health, host_port_for(t, health.port)
            loc.tracker.config = health
            up = await asyncio.to_thread(self.runtime.exit_code, t.id) is None
            argv: tuple[str, ...] = ()
            if not up:
                if self.runtime.name == "process":
                    # in the loop's own thread: a child's death signal follows its parent thread
                    argv = self.launcher.resume(t)
                else:
                    argv = await asyncio.to_thread(self.launcher.resume, t)
        except ContainerGone:
            await self._report(t.id, "failed", "container gone at wake", fault="container_lost")
            return
        except (LaunchFailed, PortInUse, ValueError) as exc:
            await self._report(t.id, "failed", f"wake failed: {exc}")
            return
        now = self.clock.monotonic()
        loc.argv = argv or loc.argv
        loc.tracker.resume(now)  # D2: a fresh start period from the real restart
        loc.waking, loc.woken_at, loc.reported_running = True, now, False
        self.local[t.id] = loc
        log.info("task %s waking: engine %s", t.id, "already up" if up else "started again")
        await self._open_load(loc, wake=True)  # D5: no fixed limit, its load decides

    async def _stop_asleep(self, task_id: str) -> None:
        """A task stopped or deleted while asleep: remove what was kept for its wake."""
        self.asleep.pop(task_id, None)
        self.stopping.add(task_id)
        try:
            self.shipper.forget(task_id)
            await asyncio.to_thread(self.runtime.stop, task_id, self.settings.stop_timeout_s)
            self.runtime.forget(task_id)
        finally:
            self.stopping.discard(task_id)
        await self._keep_doors()
        await self._report(task_id, "stopped", "stopped while asleep")

    def _life_wants_beat(self, life: NodeTaskLife) -> bool:
        """Whether the light poll saw something the heartbeat would change here."""
        for task_id in life.sleeping:
            if task_id in self.local:
                return True  # an engine to put to sleep
        for task_id in life.waking:
            loc = self.local.get(task_id)
            if (loc is None or not loc.waking) and task_id not in self.outbox:
                return True  # an engine to start again (or to watch as waking)
        listed = {*life.sleeping, *life.waking}
        return any(task_id not in listed for task_id in self.asleep)  # stopped meanwhile

    async def _life_loop(self, stop: asyncio.Event) -> None:
        """Between heartbeats: ask which tasks sleep or wake; a change wakes the
        heartbeat loop at once (only while inference engines run or sleep here)."""
        interval = self.settings.task_life_poll_interval_s
        if interval <= 0:
            return
        while not stop.is_set():
            busy = self.asleep or any(
                loc.task.task_type == "inference" for loc in self.local.values()
            )
            if busy and self.client.node_id:
                try:
                    if self._life_wants_beat(await self.client.task_life()):
                        self._nudge.set()
                except Exception as exc:
                    log.debug("task-life poll failed: %s", exc)
            if await interruptible_sleep(stop, interval):
                return

