"""Sleep and wake (F1, F2, D2) on the node.

A task listed ``sleeping`` whose engine runs here is put to sleep one of two ways
(``core.engines.sleep`` decides which, once, for the recipe and for this):

* **kept** — an engine started with vLLM's sleep mode (vLLM on CUDA cards) gets
  ``POST /sleep?level=1`` (its weights copied to host memory, the card's memory freed)
  and stays up; its wake is ``POST /wake_up`` — seconds, no reload. A node whose free
  memory cannot hold the weights, or a sleep route that fails, stops the engine instead,
  as does a card lent to training (F5: ``Starting._free_cards``).
* **stopped** — every other engine: a vLLM-family engine first gets ``POST
  /sleep?level=2`` (skipped when it lacks it), then the engine is stopped — the container
  kept (Docker), a process simply gone. Its wake starts the same container again (gone:
  the task fails with ``container_lost``, F3) or launches the same argv again.

Either way its health checks pause with their counter reset, and the task's status says
how it sleeps (a ``sleeping`` report with the note ``asleep``). A sleeping task with no
engine is normal (never "lost"), its kept container is no zombie. A woken engine is
watched like any engine, with a fresh start period and — for one started again — a load
window that follows its load (D5: no fixed limit; stopped once its load stalls), and
reported ``running`` at its first passing health check. Between heartbeats a light poll
(``task_life_poll_interval_s``) asks the server which tasks sleep or wake, so both reach
the engine within a fraction of a second rather than at the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging

from heteroflow.agent.engine_sleep import EngineSleepError, VllmSleep
from heteroflow.agent.fetching import for_launch
from heteroflow.agent.launch import host_port_for
from heteroflow.agent.load_progress import model_size
from heteroflow.agent.loading import Loading
from heteroflow.agent.runtime.protocol import ContainerGone, LaunchFailed, PortInUse
from heteroflow.agent.state import Local
from heteroflow.core.clock import interruptible_sleep
from heteroflow.core.containers import VLLM_FAMILY
from heteroflow.core.engines.commands import SLEEP_MODE_FLAG
from heteroflow.core.engines.sleep import SleepMode, keep_fits, sleep_mode
from heteroflow.core.gang import serves_api
from heteroflow.core.health import HealthCheckConfig
from heteroflow.core.loading import size_text
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.schemas.sleep import NodeTaskLife

log = logging.getLogger(__name__)


class SleepWake(Loading):
    """The agent's part that puts engines to sleep and wakes them."""

    async def _to_sleep(self, t: TaskAssignment, managed: dict[str, str]) -> None:
        """F1: put the engine of a task listed sleeping to sleep, if it still runs here:
        kept up and asleep where it was started with vLLM's sleep mode, else stopped."""
        held = self.asleep.get(t.id)
        if t.id not in self.local and held is not None and held.kept:
            held.task = t
            if managed.get(t.id) != "running":  # it exited while asleep: a wake starts it
                held.kept = False
            return
        # Out of `local` first: the watcher must not take the exit we cause for a crash.
        loc = self.local.pop(t.id, None)
        engine_up = loc is not None or managed.get(t.id) == "running"
        if loc is None:
            loc = held or self._local_for(t)  # after an agent restart
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
            mode = await self._keep_asleep(loc)
            if not mode.kept:
                await self._stop_engine_for_sleep(t)
        except Exception:  # the engine may still run: the next look tries again
            log.exception("could not put the engine of %s to sleep; retrying", t.id)
            return
        finally:
            self.stopping.discard(t.id)
        loc.kept = mode.kept
        log.info(
            "task %s asleep in %.1f s: %s", t.id, self.clock.monotonic() - start, mode.words()
        )
        await self._report(t.id, "sleeping", f"asleep: {mode.words()}", note="asleep")

    async def _keep_asleep(self, loc: Local) -> SleepMode:
        """Level 1 of vLLM's sleep mode for an engine started with it, the engine kept;
        otherwise (or when it cannot be done) how and why the engine is stopped instead."""
        t = loc.task
        if not loc.argv and t.engine in VLLM_FAMILY and await self._asleep_already(t):
            return SleepMode(True, "kept asleep before the agent restarted")
        if SLEEP_MODE_FLAG not in loc.argv:
            if t.engine in VLLM_FAMILY and t.gpu_required and t.parallelism != "pipeline":
                return SleepMode(False, "started without vLLM's sleep mode")
            return sleep_mode(t.engine, "", parallelism=t.parallelism)
        size = await asyncio.to_thread(model_size, t, self.runtime.name, self.config)
        free = self.host_memory()
        if size.bytes is not None and not keep_fits(size.bytes, free):
            return SleepMode(
                False, f"the host's free memory ({size_text(free)}) cannot hold its weights "
                f"({size_text(size.bytes)})",
            )
        engine = self._sleep_routes(t, self.settings.vllm_keep_timeout_s)
        try:
            await engine.sleep(1)
            if not await engine.is_sleeping():
                raise EngineSleepError("/is_sleeping says it is awake after /sleep")
        except EngineSleepError as exc:
            return SleepMode(False, f"vLLM's sleep failed: {exc}")
        return SleepMode(True, "vLLM on CUDA cards")

    async def _asleep_already(self, t: TaskAssignment) -> bool:
        """An engine this agent adopted (its argv unknown) that vLLM says sleeps: one kept
        asleep before the agent restarted."""
        try:
            return await self._sleep_routes(t, self.settings.vllm_sleep_timeout_s).is_sleeping()
        except (EngineSleepError, LaunchFailed):
            return False

    async def _stop_engine_for_sleep(self, t: TaskAssignment) -> None:
        """The spec's sleep (F1): vLLM's ``/sleep?level=2`` where it answers, then the
        engine stopped — the container kept (Docker), a process simply gone."""
        # a headless stage (rank > 0 of a gang) has no HTTP routes to ask
        api = serves_api(t.parallelism, t.rank)
        how = await self._engine_sleep(t) if t.engine in VLLM_FAMILY and api else ""
        try:  # its last output first; a shipping error must never block the sleep
            await self.shipper.ship_once([t.id])
        except Exception:
            log.exception("last log round of %s failed", t.id)
        await asyncio.to_thread(self.runtime.halt, t.id, self.settings.stop_timeout_s)
        if how:
            log.info("task %s: %s", t.id, how)

    def _sleep_routes(self, t: TaskAssignment, timeout_s: float) -> VllmSleep:
        """The engine's sleep routes, over the loopback: its door never lets them through
        (C14)."""
        port = host_port_for(t)
        base = f"http://{self.launcher.probe_host_for(t, port)}:{port}"
        return VllmSleep(self._session(), base, t.engine_key, timeout_s)

    async def _engine_sleep(self, t: TaskAssignment) -> str:
        """vLLM's ``POST /sleep?level=2`` before the stop (F1); what happened, in words.
        An engine without it (sleep mode off: 404) or not answering is skipped."""
        try:
            engine = self._sleep_routes(t, self.settings.vllm_sleep_timeout_s)
        except LaunchFailed:
            return "no engine port: /sleep skipped"
        try:
            await engine.sleep(2)
        except EngineSleepError as exc:
            return f"{exc} (sleep mode off?): skipped"
        return "vLLM sleep level 2 done"

    async def _wake(self, t: TaskAssignment) -> None:
        """F2, C2's resume branch: wake the engine of a task listed waking — ``/wake_up``
        for one kept asleep, else start it again."""
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
        if t.gang is None and loc.task.gang is not None and t.parallelism == "pipeline":
            # issue 32: a stage keeps its placement while asleep, so its place in the gang
            # is the one it slept with (the heartbeat lists none while the gang is not whole)
            t = t.model_copy(update={"gang": loc.task.gang})
        try:
            health = HealthCheckConfig.from_api(t.health_check)  # D4: maybe changed
            loc.task, loc.health, loc.port = t, health, host_port_for(t, health.port)
            loc.tracker.config = health
            up = await asyncio.to_thread(self.runtime.exit_code, t.id) is None
            woken = up and loc.kept and await self._wake_kept(t)
            if up and loc.kept and not woken:  # its weights did not come back: reload
                await asyncio.to_thread(self.runtime.halt, t.id, self.settings.stop_timeout_s)
                up = False
            argv: tuple[str, ...] = ()
            if not up:
                given = await for_launch(self, t)  # issue 29: its fetched model's entry
                if self.runtime.name == "process":
                    # in the loop's own thread: a child's death signal follows its parent thread
                    argv = self.launcher.resume(given)
                else:
                    argv = await asyncio.to_thread(self.launcher.resume, given)
        except ContainerGone:
            await self._report(t.id, "failed", "container gone at wake", fault="container_lost")
            return
        except (LaunchFailed, PortInUse, ValueError) as exc:
            await self._report(t.id, "failed", f"wake failed: {exc}")
            return
        now = self.clock.monotonic()
        loc.argv = argv or loc.argv
        loc.kept = False
        loc.tracker.resume(now)  # D2: a fresh start period from the real restart
        loc.waking, loc.woken_at, loc.reported_running = True, now, False
        self.local[t.id] = loc
        how = "woken in its memory" if woken else "already up" if up else "started again"
        log.info("task %s waking: engine %s", t.id, how)
        if not woken:  # a kept engine's weights come from host memory, not its disk
            await self._open_load(loc, wake=True)  # D5: no fixed limit, its load decides

    async def _wake_kept(self, t: TaskAssignment) -> bool:
        """``POST /wake_up`` on an engine kept asleep; False (and why, in the log) when
        it failed, so that the caller starts the engine again instead."""
        engine = self._sleep_routes(t, self.settings.vllm_keep_timeout_s)
        try:
            await engine.wake_up()
            if await engine.is_sleeping():
                raise EngineSleepError("/is_sleeping says it still sleeps after /wake_up")
        except EngineSleepError as exc:
            log.warning("task %s: vLLM's wake failed (%s); starting its engine again", t.id, exc)
            return False
        return True

    async def _stop_asleep(self, task_id: str) -> None:
        """A task stopped or deleted while asleep: remove what was kept for its wake."""
        self.asleep.pop(task_id, None)
        self._release_model(task_id)
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

