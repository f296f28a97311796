"""What the node agent holds about the engines on its node, and the acts all its parts
share: report to the server (an outbox: a report that cannot be delivered is kept and
retried, nothing is silently lost) and stop an engine.

The agent itself (``daemon.Agent``) is this state with its parts: starting engines
(``starting``), putting them to sleep and waking them (``sleep_wake``), watching them
(``watch``), and the heartbeat that converges on the server's list (``daemon``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from heteroflow.agent.client import ServerClient, ServerError
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.inventory import NvmlDiscovery, node_labels
from heteroflow.agent.launch import Launcher, host_port_for
from heteroflow.agent.load_progress import (
    READ_RATE_FILE,
    EngineProgress,
    ProgressSource,
    read_rate_from,
)
from heteroflow.agent.log_shipper import LogShipper
from heteroflow.agent.metrics import AgentMetrics
from heteroflow.agent.model_cache import ModelCache
from heteroflow.agent.model_scan import ModelScanner, default_cache_dir, scan_dirs
from heteroflow.core.clock import Clock
from heteroflow.core.health import HealthCheckConfig, HealthTracker
from heteroflow.core.loading import LoadPolicy, LoadWatch, ReadRate
from heteroflow.core.ports import host_ports, ports_from_dicts
from heteroflow.core.retry import Backoff
from heteroflow.logs import register_secrets
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.settings import AgentSettings

log = logging.getLogger(__name__)
#: Reports that are notes on a task that keeps its state (a launch retry, a load's news,
#: how an engine sleeps).
NOTE_STATUSES = frozenset({"starting", "waking", "sleeping"})


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
    note: str | None = None  # a note on a starting / waking task: what kind (D5)


@dataclass
class Local:
    task: TaskAssignment
    tracker: HealthTracker
    health: HealthCheckConfig
    port: int
    argv: tuple[str, ...] = ()
    reported_running: bool = False
    # F2: resumed after a sleep, not yet reported running
    waking: bool = False
    woken_at: float = 0.0
    probed_at: float | None = None  # the last health probe (the wake's quick probes)
    # D5: its load window (launched or woken, no pass yet): the watch, the disk of its
    # model, when it was last sampled and when its status message last said how far
    load: LoadWatch | None = None
    load_disk: str | None = None
    load_sampled_at: float | None = None
    load_noted_at: float = 0.0
    # F1: asleep with its engine kept up (vLLM's sleep mode, core.engines.sleep)
    kept: bool = False


class AgentState:
    """The agent's state (one per node) and the acts every part of it uses."""

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
        self.metrics = AgentMetrics(self.name)
        self.metrics_port: int | None = None  # the port it was bound to, once served
        # issue 29: where this agent serves its model cache to the others, once bound
        # (agent/peer_server.py; '' for nowhere: peer_port unset, no node token)
        self.peer_url = ""
        self.local: dict[str, Local] = {}
        self.stopping: set[str] = set()  # being stopped right now: neither adopt nor reap
        # H7: launches that may pull an image first run beside the heartbeat (a pull can
        # take minutes): task id -> its launch; the convergence leaves them alone
        self.launching: dict[str, asyncio.Task[None]] = {}
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
        # F1: the host's free memory now (whether a kept sleep can hold an engine's weights)
        self.host_memory: Callable[[], int] = _available_memory
        # issue 29: the node's model cache (made on first use) and, per task, the cache
        # entry its launch was given (key, path): pinned until the task stops here
        self._model_cache: ModelCache | None = None
        self.fetched: dict[str, tuple[str, Path]] = {}
        self._notes: set[asyncio.Task[None]] = set()
        self.host_ports: list[int] = []  # listening on this host at the last look
        # D5: how loads are sampled and judged, and this node's read rate for them
        self.progress: ProgressSource = EngineProgress(self.runtime)
        self.load_policy = LoadPolicy(settings.load_stall_s, settings.load_ceiling_s)
        default_rate = ReadRate(settings.load_default_read_mb_s * 1e6)
        self.read_rate = read_rate_from(settings.work_dir / READ_RATE_FILE, default_rate)

    def _local_for(self, t: TaskAssignment) -> Local:
        """A fresh record of a task's engine here, its health check from the task."""
        health = HealthCheckConfig.from_api(t.health_check)
        tracker = HealthTracker(health, started_at=self.clock.monotonic())
        return Local(task=t, tracker=tracker, health=health, port=host_port_for(t, health.port))

    # -- stopping and reporting ----------------------------------------------------
    async def _stop(
        self, task_id: str, status: str, message: str, fault: str | None = None
    ) -> None:
        # Out of `local` first: the watcher must not take the exit we cause for a crash.
        loc = self.local.pop(task_id, None)
        if loc is not None:
            self._release_ports(loc.task)
        self._release_model(task_id)
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
        await self._keep_doors()
        await self._report(task_id, status, message, fault=fault)

    async def _keep_doors(self) -> None:
        """C14: the doors of exactly the engines this agent runs or keeps asleep — closed
        as soon as an engine is gone, so its port is free at the next heartbeat."""
        held = [loc.task for loc in (*self.local.values(), *self.asleep.values())]
        await asyncio.to_thread(self.launcher.keep_doors, held)

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
        note: str | None = None,
    ) -> None:
        """Report an outcome, or a note on a task still starting or waking (a launch
        retried; D5: ``note`` "loading" at a load's start, "progress" while it loads) —
        a note never hides an outcome still waiting to be delivered, a newer note
        replaces an older one."""
        if status in NOTE_STATUSES:
            waiting = self.outbox.get(task_id)
            if waiting is not None and (waiting.status not in NOTE_STATUSES or note is None):
                return
        self.outbox[task_id] = Outgoing(status, message, argv, fault, busy_ports, note)
        await self._flush_outbox()

    async def _flush_outbox(self) -> None:
        for task_id, out in list(self.outbox.items()):
            status = out.status
            try:
                await self.client.report(
                    task_id, status, out.message, out.argv, out.fault, out.busy_ports, note=out.note
                )
            except ServerError as exc:
                # the server moved on; nothing to deliver — unless it lost a race with
                # another write to the task and asks for the report again (two launches
                # of one group reporting at once, H7's concurrent launches among them)
                if exc.status in (404, 409) and "report again" not in str(exc):
                    log.info("report %s for %s dropped: %s", status, task_id, exc)
                else:
                    continue
            except Exception as exc:  # network: keep it for the next round
                log.warning("report %s for %s not delivered: %s", status, task_id, exc)
                continue
            self.outbox.pop(task_id, None)

    @property
    def model_cache(self) -> ModelCache:
        if self._model_cache is None:
            root = self.settings.model_cache_dir or self.settings.work_dir / "models"
            budget = int(self.settings.model_cache_budget_gb * 1024**3) or None
            self._model_cache = ModelCache(root, clock=self.clock, budget_bytes=budget,
                                           tls=fleet_tls(self.settings.ca_file))
        return self._model_cache

    def _release_model(self, task_id: str) -> None:
        """The model cache entry a stopped task was given may be evicted again."""
        held = self.fetched.pop(task_id, None)
        if held is not None:
            self.model_cache.release(held[0])

    def note_later(self, task_id: str, text: str, kind: str) -> None:
        """A note on a starting task from a callback that cannot await (a download's
        progress): sent beside the caller, in this loop."""
        note = asyncio.get_running_loop().create_task(
            self._report(task_id, "starting", text, note=kind)
        )
        self._notes.add(note)
        note.add_done_callback(self._notes.discard)

    def _session(self) -> aiohttp.ClientSession:
        """The HTTP session this agent talks to its engines with (health probes, /sleep)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http


def fleet_tls(ca_file: Path | None) -> ssl.SSLContext | bool:
    """How the model cache verifies https: the default CAs (the hubs, a mirror) plus the
    fleet's own CA when one is set (another node's agent serving copies over TLS)."""
    if ca_file is None:
        return True
    ctx = ssl.create_default_context()
    ctx.load_verify_locations(cafile=str(ca_file))
    return ctx


def _available_memory() -> int:
    return int(psutil.virtual_memory().available)
