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

Its parts: the state and the outbox (``state``), starting engines (``starting``), sleep
and wake (``sleep_wake``), watching engines (``watch``); this module is the heartbeat,
the convergence on the server's list and the loops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable

from heteroflow.agent.adapters import Adapters
from heteroflow.agent.cache_report import cache_report
from heteroflow.agent.file_requests import serve_file_requests
from heteroflow.agent.host_ports import listening_ports
from heteroflow.agent.inventory import NodeInventory, collect_inventory
from heteroflow.agent.launch import host_port_for
from heteroflow.agent.metrics import engine_counts, serve_metrics
from heteroflow.agent.model_requests import ModelRequests
from heteroflow.agent.peer_server import serve_peers
from heteroflow.agent.prepull import Prepulls
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.agent.sleep_wake import SleepWake
from heteroflow.agent.starting import Starting
from heteroflow.agent.state import Local, Outgoing
from heteroflow.agent.watch import Watching
from heteroflow.core.clock import interruptible_sleep
from heteroflow.core.health import HealthCheckConfig
from heteroflow.schemas.nodes import (
    GpuCardWire,
    Heartbeat,
    InventoryWire,
    ModelWire,
    TaskAssignment,
)
from heteroflow.settings import retired_agent_settings

log = logging.getLogger(__name__)
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


class Agent(SleepWake, Watching, Starting, Adapters):
    """The node agent: its state (``AgentState``) with every part, and the heartbeat."""

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
            model_cache=cache_report(self),  # issue 29: the scheduler prefers a holder
            # C4: the server refuses at create a model path this node would refuse
            allowed_volume_prefixes=list(self.config.allowed_volume_prefixes),
            denied_volume_prefixes=list(self.config.denied_volume_prefixes),
            host_ports_in_use=self.host_ports,
            peer_url=self.peer_url,  # issue 29: the others copy models from here
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
            if t.id in self.outbox or t.id in self.stopping or t.id in self.launching:
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
                loc = self._adopt(t)  # C2: an engine that outlived the agent, watched again
                if not loc.reported_running:  # D5: it may still be loading: judged from now
                    await self._open_load(loc, wake=False)
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
        await self._keep_doors()  # C14: and open those of engines adopted just now
        self._sync_adapters()  # LoRA adapters into running engines, beside the beat

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

    # -- loops ---------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        for line in retired_agent_settings(os.environ):  # set, it would do nothing silently
            log.warning(line)
        watcher = asyncio.create_task(self._watch_loop(stop))
        aux = asyncio.create_task(self._aux_loop(stop))
        life = asyncio.create_task(self._life_loop(stop))
        served = asyncio.create_task(self._serve_metrics(stop))  # issue 18 (P3)
        peers = asyncio.create_task(serve_peers(self, stop, self._peers_bound))  # issue 29
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
            peers.cancel()
            await asyncio.gather(watcher, aux, life, served, peers, return_exceptions=True)
            await self.shutdown()

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

    async def _serve_metrics(self, stop: asyncio.Event) -> None:
        """GET /metrics on HETEROFLOW_AGENT_METRICS_PORT, when set (issue 18, P3)."""
        port = self.settings.metrics_port
        if port is not None:
            host = self.settings.metrics_host
            await serve_metrics(self.metrics_text, host, port, stop, self._metrics_bound)

    def _metrics_bound(self, port: int) -> None:
        self.metrics_port = port

    def _peers_bound(self, url: str) -> None:
        self.peer_url = url

    def metrics_text(self) -> bytes:
        running = [(loc.task.engine, loc.reported_running) for loc in self.local.values()]
        asleep = [loc.task.engine for loc in self.asleep.values()]
        return self.metrics.render(engine_counts(running, asleep))

    async def _aux_loop(self, stop: asyncio.Event) -> None:
        """Log shipping (C6), file requests (C7), a recreate's pre-pulls (J2, H7) and
        the operator's model pulls and evictions (issue 29), apart from the heartbeat."""
        prepulls = Prepulls()
        models = ModelRequests()  # issue 29: `heteroflow models pull/evict`
        try:
            while not stop.is_set():
                try:
                    await self.shipper.ship_once(list(self.local))
                    await serve_file_requests(
                        self.client, self._file_roots, self.settings.file_chunk_bytes
                    )
                except Exception:
                    log.exception("log / file-request round failed")
                try:
                    await prepulls.round(self)
                except Exception as exc:  # the server away: its heartbeat says so already
                    log.debug("pre-pull round failed: %s", exc)
                try:
                    await models.round(self)
                except Exception as exc:  # the server away: asked again next round
                    log.debug("model request round failed: %s", exc)
                if await interruptible_sleep(stop, self.settings.log_ship_interval_s):
                    return
        finally:
            prepulls.cancel()
            models.cancel()

    def _file_roots(self, task_id: str) -> list[str]:
        loc = self.local.get(task_id)
        return self.launcher.file_roots(loc.task) if loc is not None else []

    async def shutdown(self) -> None:
        """Stop the engines (process runtime, or when asked) and tell the server.

        Containers are left running by default: a restarted agent adopts them (C2).
        """
        if self._lora_round is not None:
            self._lora_round.cancel()  # LoRA loads end with the agent (its engines may)
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
