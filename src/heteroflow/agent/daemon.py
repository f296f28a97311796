"""The node agent: heartbeat, claim, launch, watch, health-check, stop, report.

Each heartbeat the server answers with the tasks placed on this node that should be
starting or running. The agent converges on that list (level-triggered): it claims and
launches ``scheduled`` tasks, stops anything it runs that is no longer listed (deleted
or stopped tasks — the process runtime's zombie cleanup), and gives a listed task whose
engine is gone (it stopped with the agent: a restart) back as ``scheduled`` instead of
leaving it "running" — not failed: the same placement is claimed and started again, no
rebuild counted. The agent's own shutdown gives back the engines it stops the same way.
A watch loop detects engines that exit and runs the container-level health checks.
Reports that cannot be delivered are kept and retried; nothing is silently lost.

Sleep and wake (F1, F2, D2). A task listed ``sleeping`` whose engine runs here is put to
sleep: a vLLM-family engine first gets ``POST /sleep?level=2`` (skipped when it lacks
it), then the engine is stopped — the container is kept (Docker), a process is simply
gone — and its health checks pause with their counter reset. Nothing is reported: the
task is already sleeping, and a sleeping task with no engine is normal (never "lost"),
its kept container is no zombie. A task listed ``waking`` resumes (C2's resume branch):
the same container starts again (gone: the task fails with ``container_lost``, F3), or
the same argv is launched again; it is watched like any engine, with a fresh start
period, and reported ``running`` at its first passing health check, or ``failed`` when
that has not come within ``wake_ready_timeout_s``. Between heartbeats a light poll
(``task_life_poll_interval_s``) asks the server which tasks sleep or wake, so both reach
the engine within a fraction of a second rather than at the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from heteroflow.agent.client import ServerClient, ServerError
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.file_requests import serve_file_requests
from heteroflow.agent.health_probe import probe
from heteroflow.agent.host_ports import listening_ports
from heteroflow.agent.inventory import (
    NodeInventory,
    NvmlDiscovery,
    collect_inventory,
    node_labels,
)
from heteroflow.agent.launch import Launcher, host_port_for
from heteroflow.agent.log_shipper import LogShipper
from heteroflow.agent.metrics import AgentMetrics, engine_counts, nvml_utilisation, serve_metrics
from heteroflow.agent.model_scan import ModelScanner, default_cache_dir, scan_dirs
from heteroflow.agent.runtime.protocol import ContainerGone, LaunchFailed, PortInUse
from heteroflow.core.clock import Clock, interruptible_sleep
from heteroflow.core.containers import VLLM_FAMILY
from heteroflow.core.health import HealthCheckConfig, HealthTracker, HealthVerdict
from heteroflow.core.ports import host_ports, ports_from_dicts
from heteroflow.core.retry import Backoff
from heteroflow.logs import register_secrets
from heteroflow.schemas.nodes import (
    GpuCardWire,
    Heartbeat,
    InventoryWire,
    ModelWire,
    TaskAssignment,
)
from heteroflow.schemas.sleep import NodeTaskLife
from heteroflow.settings import AgentSettings

log = logging.getLogger(__name__)
MODEL_SCAN_EVERY = 12  # heartbeats (C10)


# Each pause between two heartbeats is the interval ±10 %, drawn anew. Without it a
# fleet whose beats were once lined up stays lined up: a stall of the server (a database
# failover) that every agent's beat waited through is answered at once when it ends, and
# every agent beats again one interval later, together, for ever — each interval one
# burst instead of an even stream (bench/control_plane.py --spread-s: one server that
# holds 2,500 agents spread evenly misses at 1,500 beating within one second). With the
# jitter the phases drift apart by themselves: at 5 s, by about 0.3 s times the square
# root of the beats since.
BEAT_JITTER = 0.1


def beat_pause(interval_s: float, draw: Callable[[], float] = random.random) -> float:
    """Seconds until the next heartbeat: ``interval_s`` ± ``BEAT_JITTER``, uniformly."""
    return interval_s * (1.0 - BEAT_JITTER + 2.0 * BEAT_JITTER * draw())


@dataclass(frozen=True)
class Retry:
    task: TaskAssignment
    due: float
    attempt: int
    first_try: float


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A report waiting to reach the server (kept until it does, one per task)."""

    status: str
    message: str
    argv: list[str] | None = None
    fault: str | None = None
    busy_ports: tuple[int, ...] = ()


@dataclass
class Local:
    task: TaskAssignment
    tracker: HealthTracker
    health: HealthCheckConfig
    port: int
    argv: tuple[str, ...] = ()
    reported_running: bool = False
    # F2: resumed after a sleep, not yet reported running; when it must be ready by
    waking: bool = False
    woken_at: float = 0.0
    wake_deadline: float = 0.0
    probed_at: float | None = None  # the last health probe (the wake's quick probes)


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        config: NodeConfig,
        launcher: Launcher,
        clock: Clock,
        nvml: NvmlDiscovery | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.launcher = launcher
        self.runtime = launcher.runtime
        self.clock = clock
        self.nvml = nvml if nvml is not None else NvmlDiscovery()
        self.labels = node_labels(self.config.labels)
        self.client = ServerClient(
            settings.server_url, settings.node_token, settings.request_timeout_s,
            ca_file=settings.ca_file,
        )
        self.name = settings.node_name or socket.gethostname()
        register_secrets(settings.node_token)  # issue 18 (P3): never in a log line
        # issue 18 (P3): served on HETEROFLOW_AGENT_METRICS_PORT when set (agent/metrics.py)
        served = settings.metrics_port is not None
        self.metrics = AgentMetrics(self.name, nvml_utilisation if served else None)
        self.metrics_port: int | None = None  # the port it was bound to, once served
        self.local: dict[str, Local] = {}
        self.stopping: set[str] = set()  # being stopped right now: neither adopt nor reap
        # F1: tasks asleep here (engine stopped; Docker: container kept), health paused
        self.asleep: dict[str, Local] = {}
        self._nudge = asyncio.Event()  # the light poll wants a heartbeat now
        self.retry: dict[str, Retry] = {}  # port conflicts waiting for their next try
        self.backoff = Backoff(total_s=settings.port_retry_total_s)
        self.scanner = ModelScanner(
            scan_dirs(config.model_scan_dirs, os.environ, default_cache_dir())
        )
        self.models: list[dict[str, Any]] = []
        self.shipper = LogShipper(self.client, launcher.log_source)
        self.beats = 0
        self.outbox: dict[str, Outgoing] = {}  # task id -> its report not yet delivered
        # host port -> when this agent stopped the task that held it: a port found taken
        # soon after may still be leaving (P2's back-off), anything else is a stranger's
        self.released: dict[int, float] = {}
        self._http: aiohttp.ClientSession | None = None
        self.host_ports: list[int] = []  # listening on this host at the last look

    # -- heartbeat and convergence -------------------------------------------------
    def _heartbeat_body(self, inv: NodeInventory) -> Heartbeat:
        return Heartbeat(
            name=self.name,
            address=self.settings.address,
            runtime="docker" if self.runtime.name == "docker" else "process",
            inventory=InventoryWire(
                gpus=[GpuCardWire(**g.to_dict()) for g in inv.gpus],
                cpu_count=inv.cpu_count,
                memory_total_mb=inv.memory_total_mb,
                memory_available_mb=inv.memory_available_mb,
                cpu_percent=inv.cpu_percent,
                memory_percent=inv.memory_percent,
            ),
            labels=self.labels,
            engines=self.launcher.engines(),
            models=[ModelWire.model_validate(m) for m in self.models],
            # C4: the server refuses at create a model path this node would refuse
            allowed_volume_prefixes=list(self.config.allowed_volume_prefixes),
            denied_volume_prefixes=list(self.config.denied_volume_prefixes),
            host_ports_in_use=self.host_ports,
        )

    async def tick(self) -> None:
        inv = await asyncio.to_thread(collect_inventory, list(self.config.gpus), self.nvml)
        self.host_ports = await asyncio.to_thread(listening_ports)
        self.launcher.observe(inv)
        if self.settings.metrics_port is not None:
            await asyncio.to_thread(self.metrics.observe_inventory, inv)
        if self.beats % MODEL_SCAN_EVERY == 0:  # full at start, by mtime every 12 beats
            scan = self.scanner.full if self.beats == 0 else self.scanner.incremental
            self.models = [m.to_dict() for m in await asyncio.to_thread(scan)]
        self.beats += 1
        reply = await self.metrics.heartbeat(self.client.heartbeat(self._heartbeat_body(inv)))
        await self._flush_outbox()
        desired = {t.id: t for t in reply.tasks}
        managed = await asyncio.to_thread(self.runtime.managed)
        for task_id in [i for i in self.retry if i not in desired]:
            del self.retry[task_id]  # deleted or stopped while waiting for its port
            await self._report(task_id, "stopped", "stopped before it could start")
        for t in reply.tasks:
            if t.id in self.retry:
                r = self.retry[t.id]
                if self.clock.monotonic() >= r.due:
                    await self._launch(r.task, attempt=r.attempt, first_try=r.first_try)
                continue
            if t.id in self.outbox or t.id in self.stopping:
                continue
            if t.status == "sleeping":
                await self._to_sleep(t, managed)
                continue
            if t.status == "waking" or t.id in self.asleep:
                await self._wake(t)
                continue
            if t.id in self.local:
                self._follow(self.local[t.id], t)
                continue
            if t.status == "scheduled":
                if t.id in managed:  # a leftover of an earlier attempt under our labels
                    await asyncio.to_thread(self.runtime.remove, t.id)
                await self._claim_and_start(t)
            elif managed.get(t.id) == "running":
                self._adopt(t)  # C2: an engine that outlived the agent is watched again
            elif t.id not in managed:  # starting/running on the server, no engine here
                await self._report(t.id, "scheduled", self._gone_with_agent())
            else:  # a container that exited while the agent was away: its own exit
                await self._report(
                    t.id,
                    "failed",
                    "container exited while the agent was away",
                    fault="container_lost",
                )
        for task_id in list(self.local):
            if task_id not in desired:
                await self._stop(task_id, "stopped", "stopped by the server")
                managed.pop(task_id, None)  # stopped and removed just now: not a zombie
        for task_id in list(self.asleep):
            if task_id not in desired:  # stopped or deleted while asleep
                await self._stop_asleep(task_id)
                managed.pop(task_id, None)
        await self._reap(managed, desired)
        held = [loc.task for loc in (*self.local.values(), *self.asleep.values())]
        await asyncio.to_thread(self.launcher.keep_doors, held)  # C14

    async def _reap(self, managed: dict[str, str], desired: dict[str, TaskAssignment]) -> None:
        """C8: remove what this agent started that the server no longer lists.

        Runs only after a heartbeat succeeded (the server's list was read); the runtime
        lists only what carries this agent's own labels, never anything by name alone.
        """
        for task_id in managed:
            if task_id in desired or task_id in self.local or task_id in self.stopping:
                continue
            log.warning("removing %s: the server does not list it (zombie cleanup)", task_id)
            await asyncio.to_thread(self.runtime.remove, task_id)

    def _gone_with_agent(self) -> str:
        """Why a listed task has no engine here: it stopped with this agent (a process
        dies with its agent; a container is gone). Not the task's failure: the server
        gives it back as ``scheduled`` on this node, and it is claimed and started again."""
        what = "container" if self.runtime.name == "docker" else "engine process"
        return f"{what} gone when the agent came back; starting it again on this node"

    def _follow(self, loc: Local, t: TaskAssignment) -> None:
        """The server's latest word on a task this agent runs: a health check changed
        alone (D4, no rebuild) applies from now on."""
        if t.health_check != loc.task.health_check:
            try:
                health = HealthCheckConfig.from_api(t.health_check)
                port = host_port_for(t, health.port)
            except (ValueError, LaunchFailed) as exc:
                log.warning("task %s: new health check not applied: %s", t.id, exc)
                return
            loc.health = health
            loc.tracker.config = health
            loc.port = port
            log.info("task %s: health check changed; applied", t.id)
        loc.task = t

    def _local_for(self, t: TaskAssignment) -> Local:
        health = HealthCheckConfig.from_api(t.health_check)
        tracker = HealthTracker(health, started_at=self.clock.monotonic())
        return Local(task=t, tracker=tracker, health=health, port=host_port_for(t, health.port))

    # -- sleep and wake (F1, F2) -----------------------------------------------------
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
            if not loc.waking:
                loc.tracker.resume(now)  # probed at once, reported running when it passes
                loc.waking, loc.woken_at = True, now
                loc.wake_deadline = now + self.settings.wake_ready_timeout_s
                loc.reported_running = False
            loc.task = t
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
        loc.wake_deadline = now + self.settings.wake_ready_timeout_s
        self.local[t.id] = loc
        log.info("task %s waking: engine %s", t.id, "already up" if up else "started again")

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

    async def _pause(self, stop: asyncio.Event, seconds: float) -> bool:
        """Wait for the next heartbeat: its interval, a nudge from the light poll, or
        ``stop`` (True)."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._nudge.wait())]
        try:
            await asyncio.wait(
                waits, timeout=max(seconds, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return stop.is_set()

    def _adopt(self, t: TaskAssignment) -> None:
        health = HealthCheckConfig.from_api(t.health_check)
        tracker = HealthTracker(health, started_at=self.clock.monotonic())
        self.local[t.id] = Local(
            task=t,
            tracker=tracker,
            health=health,
            port=host_port_for(t, health.port),
            reported_running=t.status == "running",
        )
        log.info("adopted running %s %s", self.runtime.name, t.id)

    async def _claim_and_start(self, t: TaskAssignment) -> None:
        try:
            t = await self.client.claim(t.id)
        except ServerError as exc:
            log.info("claim of %s refused: %s", t.id, exc)
            return
        await self._launch(t, attempt=1, first_try=self.clock.monotonic())

    async def _launch(self, t: TaskAssignment, *, attempt: int, first_try: float) -> None:
        self.retry.pop(t.id, None)
        try:
            health = HealthCheckConfig.from_api(t.health_check)
            port = host_port_for(t, health.port)
            if self.launcher.runtime.name == "process":
                # in the loop's own thread: a child's death signal follows its parent thread
                argv = self.launcher.launch(t)
            else:
                argv = await asyncio.to_thread(self.launcher.launch, t)
        except PortInUse as exc:
            self.metrics.launched("port_busy")
            await self._port_taken(t, exc, attempt, first_try)
            return
        except (LaunchFailed, ValueError) as exc:
            self.metrics.launched("failed")
            await self._report(t.id, "failed", f"launch failed: {exc}")
            return
        self.metrics.launched("started")
        tracker = HealthTracker(health, started_at=self.clock.monotonic())
        self.local[t.id] = Local(task=t, tracker=tracker, health=health, port=port, argv=argv)

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

    async def _stop(
        self, task_id: str, status: str, message: str, fault: str | None = None
    ) -> None:
        # Out of `local` first: the watcher must not take the exit we cause for a crash.
        loc = self.local.pop(task_id, None)
        if loc is not None:
            self._release_ports(loc.task)
        self.stopping.add(task_id)
        try:
            try:  # its last output first; a shipping error must never block the stop
                await self.shipper.ship_once([task_id])
            except Exception:
                log.exception("last log round of %s failed", task_id)
            self.shipper.forget(task_id)
            await asyncio.to_thread(self.runtime.stop, task_id, self.settings.stop_timeout_s)
            self.runtime.forget(task_id)
        finally:
            self.stopping.discard(task_id)
        await self._report(task_id, status, message, fault=fault)

    def _release_ports(self, t: TaskAssignment) -> None:
        now = self.clock.monotonic()
        for port in host_ports(ports_from_dicts(t.ports), chosen_only=True):
            self.released[port] = now

    async def _report(
        self,
        task_id: str,
        status: str,
        message: str,
        argv: list[str] | None = None,
        fault: str | None = None,
        busy_ports: tuple[int, ...] = (),
    ) -> None:
        if status == "starting" and task_id in self.outbox:
            return  # a note never hides an outcome still waiting to be delivered
        self.outbox[task_id] = Outgoing(status, message, argv, fault, busy_ports)
        await self._flush_outbox()

    async def _flush_outbox(self) -> None:
        for task_id, out in list(self.outbox.items()):
            status = out.status
            try:
                await self.client.report(
                    task_id, status, out.message, out.argv, out.fault, out.busy_ports
                )
            except ServerError as exc:
                if exc.status in (404, 409):  # the server moved on; nothing to deliver
                    log.info("report %s for %s dropped: %s", status, task_id, exc)
                else:
                    continue
            except Exception as exc:  # network: keep it for the next round
                log.warning("report %s for %s not delivered: %s", status, task_id, exc)
                continue
            self.outbox.pop(task_id, None)

    # -- watching engines ----------------------------------------------------------
    async def watch_once(self) -> None:
        for task_id, loc in list(self.local.items()):
            if self.local.get(task_id) is not loc:
                continue  # stopped (or replaced) while this round awaited
            code = self.runtime.exit_code(task_id)
            if code is not None:
                tail = self.runtime.log_tail(task_id, 20)
                try:
                    await self.shipper.ship_once([task_id])  # its last words matter most
                except Exception:
                    log.exception("last log round of %s failed", task_id)
                self.shipper.forget(task_id)
                self.runtime.forget(task_id)
                self.local.pop(task_id, None)
                self._release_ports(loc.task)
                if code == -1 and self.runtime.name == "docker":
                    await self._report(
                        task_id,
                        "failed",
                        "container removed behind the agent's back",
                        fault="container_lost",
                    )
                elif code == 0 and loc.task.task_type != "inference":
                    await self._report(task_id, "completed", "exited with code 0")
                else:
                    await self._report(
                        task_id,
                        "failed",
                        f"engine exited with code {code}; last output:\n{tail}",
                        list(loc.argv),
                        # a negative code is a signal: killed behind the agent's back
                        fault="engine_exited" if code >= 0 else "container_lost",
                    )
                continue
            now = self.clock.monotonic()
            if loc.waking and now >= loc.wake_deadline:
                limit = self.settings.wake_ready_timeout_s
                await self._stop(
                    task_id,
                    "failed",
                    f"not ready {limit:g} s after its wake (F2); last health check: "
                    f"{loc.tracker.last_detail or 'none passed'}",
                    fault="unhealthy",
                )
                continue
            if not (loc.tracker.due(now) or self._wake_probe_due(loc, now)):
                continue
            loc.probed_at = now
            host = self.launcher.probe_host_for(loc.task, loc.port)
            ok, detail = await probe(
                loc.health, host, loc.port, self._session(), key=loc.task.engine_key
            )
            verdict = loc.tracker.record(ok, self.clock.monotonic(), detail)
            if loc.waking and verdict in (HealthVerdict.HEALTHY_FIRST, HealthVerdict.HEALTHY):
                loc.waking, loc.reported_running = False, True
                took = self.clock.monotonic() - loc.woken_at
                await self._report(
                    task_id,
                    "running",
                    f"awake: health check passed {took:.1f} s after its wake",
                    list(loc.argv) or None,
                )
            elif verdict == HealthVerdict.HEALTHY_FIRST and not loc.reported_running:
                loc.reported_running = True
                await self._report(task_id, "running", "health check passed", list(loc.argv))
            elif verdict == HealthVerdict.IGNORED_IN_START_PERIOD:
                log.debug("task %s: health check failed in start period: %s", task_id, detail)
            elif verdict == HealthVerdict.FAILING:
                log.warning("task %s: health check failed: %s", task_id, detail)
            elif verdict == HealthVerdict.UNHEALTHY:
                await self._stop(
                    task_id,
                    "failed",
                    f"health check failed {loc.health.unhealthy_threshold} times: {detail}",
                    fault="unhealthy",
                )

    def _wake_probe_due(self, loc: Local, now: float) -> bool:
        """A waking engine is probed every ``wake_probe_interval_s`` inside its start
        period (failures there are never counted), so it serves as soon as it answers."""
        last = loc.probed_at
        return (
            loc.waking
            and not loc.tracker.paused
            and loc.tracker.in_start_period(now)
            and (last is None or now - last >= self.settings.wake_probe_interval_s)
        )

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    # -- loops ---------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        watcher = asyncio.create_task(self._watch_loop(stop))
        aux = asyncio.create_task(self._aux_loop(stop))
        life = asyncio.create_task(self._life_loop(stop))
        served = asyncio.create_task(self._serve_metrics(stop))  # issue 18 (P3)
        try:
            while not stop.is_set():
                self._nudge.clear()
                try:
                    await self.tick()
                except Exception as exc:
                    log.warning("heartbeat to %s failed: %s", self.settings.server_url, exc)
                if await self._pause(stop, beat_pause(self.settings.heartbeat_interval_s)):
                    break
        finally:
            watcher.cancel()
            aux.cancel()
            life.cancel()
            served.cancel()
            await asyncio.gather(watcher, aux, life, served, return_exceptions=True)
            await self.shutdown()

    async def _serve_metrics(self, stop: asyncio.Event) -> None:
        """GET /metrics on HETEROFLOW_AGENT_METRICS_PORT, when set (issue 18, P3)."""
        port = self.settings.metrics_port
        if port is not None:
            host = self.settings.metrics_host
            await serve_metrics(self.metrics_text, host, port, stop, self._metrics_bound)

    def _metrics_bound(self, port: int) -> None:
        self.metrics_port = port

    def metrics_text(self) -> bytes:
        running = [(loc.task.engine, loc.reported_running) for loc in self.local.values()]
        asleep = [loc.task.engine for loc in self.asleep.values()]
        return self.metrics.render(engine_counts(running, asleep))

    async def _aux_loop(self, stop: asyncio.Event) -> None:
        """Log shipping (C6) and file requests (C7), apart from the heartbeat."""
        while not stop.is_set():
            try:
                await self.shipper.ship_once(list(self.local))
                await serve_file_requests(
                    self.client, self._file_roots, self.settings.file_chunk_bytes
                )
            except Exception:
                log.exception("log / file-request round failed")
            if await interruptible_sleep(stop, self.settings.log_ship_interval_s):
                return

    def _file_roots(self, task_id: str) -> list[str]:
        loc = self.local.get(task_id)
        return self.launcher.file_roots(loc.task) if loc is not None else []

    async def _watch_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.watch_once()
            except Exception:
                log.exception("watch round failed")
            if await interruptible_sleep(stop, self.settings.watch_interval_s):
                return

    async def shutdown(self) -> None:
        """Stop the engines (process runtime, or when asked) and tell the server.

        Containers are left running by default: a restarted agent adopts them (C2).
        """
        keep = self.runtime.name == "docker" and not self.settings.stop_engines_on_exit
        ids = [] if keep else list(self.local)
        await asyncio.gather(
            *(asyncio.to_thread(self.runtime.stop, i, self.settings.stop_timeout_s) for i in ids)
        )
        for i in ids:
            self.runtime.forget(i)
            self.local.pop(i, None)
            # not the task's failure: its placement waits for this agent to come back
            self.outbox[i] = Outgoing(
                "scheduled", "agent shut down; engine stopped: it starts again on this "
                "node when the agent is back"
            )
        try:
            await asyncio.wait_for(self._flush_outbox(), timeout=3)
        except Exception:
            log.warning("could not report %d stopped task(s) at shutdown", len(self.outbox))
        await asyncio.to_thread(self.launcher.close_doors)
        if self._http is not None:
            await self._http.close()
        await self.client.aclose()
