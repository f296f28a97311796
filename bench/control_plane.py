"""Control-plane benchmark: N simulated agents heartbeating real servers on PostgreSQL.

It creates a throw-away PostgreSQL database, starts real ``heteroflow server`` processes
on it (subprocesses, the shipped defaults: scheduler, node watch, snapshot publisher and
the rest all run), and drives N simulated agents from this one process (asyncio +
aiohttp). Each agent keeps its own keep-alive connection, as the real agent's client
does, and posts ``POST /api/v1/agent/heartbeat`` every 5 s (the agent's default
``heartbeat_interval_s``, each pause ±10 % as the agent's ``beat_pause`` draws it) on
its own random phase, with the node token and, once
registered, its ``X-Heteroflow-Node`` header. Bodies are what the agent sends
(``ServerClient.heartbeat``: ``Heartbeat.model_dump()``), built from the agent's own
types (``GpuCard``, ``ScannedModel``) and the simulated 8-card node kinds of
``heteroflow.testing.clusters``: 8 cards (memory used and temperature moving every
beat, as NVML reports them), 6 scanned models (one appears or goes every ~20 beats),
20-35 host ports in use (one opens or closes every ~10 beats), engines, labels, volume
rules: 6-9 KB of JSON. Replies carry no tasks (no services run): this measures the
protocol's fixed cost.

Steps ramp N (``--steps``, default 250, 500, 1,000, 2,000, 3,000); agents of a step keep
running in the next. Each step waits a warm-up (one interval plus 5 s: the new agents
register) and then measures for ``--step-s`` seconds:
- heartbeat latency p50 / p99 / max (request sent to reply read, on this process);
- server CPU per heartbeat: the server processes' user+system CPU in the window (every
  thread: API, controllers, gateway) / heartbeats answered in it, and the same for the
  PostgreSQL backends serving the bench database (``pg_stat_activity``);
- errors (non-200 replies, timeouts, refused connections), in the window and in the
  warm-up;
- this load generator's own CPU and event-loop lag (how late an agent woke): when it
  saturates its cores the latencies are its own, and the output says so.
The ramp stops at the first step with p99 >= 50 ms or any error; "held" is the largest
N whose step had neither. Before the ramp the idle server's CPU is measured (5 s), and
after it, with the agents gone but their nodes still online, the CPU the server spends
on a fleet of that size without a heartbeat (its controllers: ``no_beats_cpu_pct``).
The same ramp then runs with two servers on the same database (``--servers 1,2``), the
agents split between them (even to the first, odd to the second), as two instances
behind a load balancer would see them.

``--workers 1,2`` (issue 31, item 5) runs each server count with each worker count:
``heteroflow server --workers N``, N processes on one port (PostgreSQL and Redis:
``$HETEROFLOW_BENCH_REDIS``, default ``redis://127.0.0.1:6379/0``). A server's CPU is
its parent's and every worker's (the process tree, read at each measurement).

CPU pinning (``--pin``): ``auto`` puts the servers on every CPU but the last and this
load generator on the last, when there are more CPUs than server processes (servers x
workers; on 2 cores: one server of one worker on CPU 0 and the load on CPU 1; two
servers, or one of two workers, are not pinned: a worker pinned to a CPU with the other
would leave the second core to the load and PostgreSQL alone); PostgreSQL is never
pinned. ``none`` pins nothing; ``S:L`` gives CPU lists (``0:1``, ``0-2:3``).

``--spread-s S`` gives the agents' phases in [0, S) instead of the whole interval: the
fleet then beats in bursts, as after a stall of the server (a database failover) that
every agent's beat waited through — the answers come at once, and each agent's next beat
one interval later, together (until the agents' jitter spreads them out again).

``--server-env NAME=VALUE`` adds a setting to the servers (experiments: e.g. slower
fleet-wide loops); ``--profile DIR`` records the first server with py-spy at each step
of the one-server ramp (collapsed stacks, GIL holders only; py-spy's pauses slow it).

Last line: one JSON object. ``--quick`` = 100, 250, 500 agents, 10 s steps, one server.
Needs PostgreSQL at ``$HETEROFLOW_BENCH_PG`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``).
Run: ``.venv/bin/python bench/control_plane.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import psutil
import psycopg

from heteroflow.agent.daemon import beat_pause
from heteroflow.agent.inventory import GpuCard
from heteroflow.agent.model_scan import ScannedModel
from heteroflow.schemas.nodes import GpuCardWire, Heartbeat, InventoryWire, ModelWire
from heteroflow.settings import AgentSettings
from heteroflow.testing import clusters
from heteroflow.testing.bench import ADMIN_URL, fresh_database, percentile
from heteroflow.workers import WORKER_HEADER  # the answering worker's pid

NODE_TOKEN = "bench-node-token"  # noqa: S105 - a throw-away server's
REDIS_URL = os.environ.get("HETEROFLOW_BENCH_REDIS", "redis://127.0.0.1:6379/0")
P99_LIMIT_MS = 50.0
HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
# what the real agent uses unless configured otherwise
INTERVAL_S = float(AgentSettings.model_fields["heartbeat_interval_s"].default)
TIMEOUT_S = float(AgentSettings.model_fields["request_timeout_s"].default)
# 8-card node kinds (percent of agents)
FLEET_MIX = (("h100-sxm-8", 45), ("a100-mig-8", 30), ("mi300x-8", 10), ("ascend-910b-8", 10),
             ("mtt-s4000-8", 5))
MODELS_PER_NODE = 6
MODEL_CHURN = 1 / 20  # chance per beat that a model appears or goes
PORT_CHURN = 1 / 10  # chance per beat that a host port opens or closes
# what listens on a GPU node: ssh, DNS, rpcbind, node exporter, DCGM, docker, engines...
BASE_PORTS = (22, 53, 111, 2049, 4369, 6379, 8000, 8080, 9100, 9400, 10250, 10256, 25000)


# -- bodies ---------------------------------------------------------------------------
def _cards(kind: clusters.ClusterKind, name: str, rng: random.Random) -> list[GpuCard]:
    """The node's cards as the agent's NVML discovery reports them (``GpuCard``)."""
    out = []
    for c in kind.cards_of(name):
        used = rng.randint(0, c.memory_total_mb)
        out.append(
            GpuCard(
                index=c.index,
                uuid=c.uuid,
                vendor=c.vendor,
                model=c.model,
                memory_total_mb=c.memory_total_mb,
                memory_used_mb=used,
                compute_capability=c.compute_capability,
                mig_capable=c.mig_capable,
                mps_capable=c.mps_capable,
                temperature_c=rng.randint(30, 80),
                source="nvml",
                nvlink_peers=tuple(c.nvlink_peers),
                mig_enabled=False if c.mig_capable else None,
                utilization_pct=rng.randint(0, 100),
            )
        )
    return out


def scanned_model(rng: random.Random, i: int) -> ScannedModel:
    """A model the agent's scan would find (an HF directory or a GGUF file)."""
    if i % 3 == 2:
        name = f"model-{i}-q4_k_m.gguf"
        return ScannedModel(
            name=name, path=f"/data/models/{name}", format="gguf",
            size_bytes=rng.randint(1, 40) << 30, files=(name,), mtime=1.7e9 + i,
        )
    name = f"org-{i % 5}/llm-{i}-{rng.choice((7, 8, 14, 32, 70))}b-instruct"
    shards = rng.randint(2, 30)
    files = ("config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "model.safetensors.index.json",
             *(f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)))
    return ScannedModel(
        name=name, path=f"/data/models/{name}", format="hf",
        size_bytes=rng.randint(10, 150) << 30, files=files, mtime=1.7e9 + i,
    )


def host_ports(rng: random.Random) -> list[int]:
    """Listening ports, lowest first (``agent.host_ports.listening_ports``)."""
    engines = rng.sample(range(20000, 30000), rng.randint(4, 16))
    ephemeral = rng.sample(range(32768, 61000), rng.randint(2, 6))
    return sorted({*BASE_PORTS, *engines, *ephemeral})


def agent_heartbeat(kind_name: str, name: str, rng: random.Random) -> Heartbeat:
    """What ``AgentDaemon._heartbeat_body`` builds for a node of that kind."""
    kind = clusters.load(kind_name)
    mem_avail = rng.randint(kind.memory_total_mb // 4, kind.memory_total_mb)
    return Heartbeat(
        name=name,
        address=f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        runtime="docker" if kind.runtime == "docker" else "process",
        inventory=InventoryWire(
            gpus=[GpuCardWire(**g.to_dict()) for g in _cards(kind, name, rng)],
            cpu_count=kind.cpu_count,
            memory_total_mb=kind.memory_total_mb,
            memory_available_mb=mem_avail,
            cpu_percent=round(rng.uniform(1, 60), 1),
            memory_percent=round(100 * (1 - mem_avail / kind.memory_total_mb), 1),
        ),
        labels={**kind.labels, "zone": f"z{rng.randint(1, 4)}"},
        engines=dict(kind.engines),
        models=[ModelWire.model_validate(scanned_model(rng, i).to_dict())
                for i in range(MODELS_PER_NODE)],
        allowed_volume_prefixes=["/data/models"],
        denied_volume_prefixes=["/data/models/private"],
        host_ports_in_use=host_ports(rng),
    )


def churn(body: dict[str, Any], rng: random.Random, beat: int) -> None:
    """One beat's changes, in place: what moves between two real heartbeats."""
    inv = body["inventory"]
    for g in inv["gpus"]:
        g["memory_used_mb"] = min(
            g["memory_total_mb"], max(0, g["memory_used_mb"] + rng.randint(-512, 512))
        )
        g["temperature_c"] = min(90, max(25, g["temperature_c"] + rng.randint(-2, 2)))
        g["utilization_pct"] = min(100, max(0, g["utilization_pct"] + rng.randint(-10, 10)))
    inv["cpu_percent"] = round(rng.uniform(1, 60), 1)
    total = inv["memory_total_mb"]
    inv["memory_available_mb"] = min(
        total, max(0, inv["memory_available_mb"] + rng.randint(-4096, 4096))
    )
    inv["memory_percent"] = round(100 * (1 - inv["memory_available_mb"] / total), 1)
    ports = body["host_ports_in_use"]
    if rng.random() < PORT_CHURN:
        if len(ports) > 40 or (len(ports) > len(BASE_PORTS) and rng.random() < 0.5):
            ports.remove(rng.choice([p for p in ports if p not in BASE_PORTS]))
        else:
            ports.append(rng.randint(20000, 30000))
            body["host_ports_in_use"] = ports = sorted(set(ports))
    models = body["models"]
    if rng.random() < MODEL_CHURN:
        if len(models) > MODELS_PER_NODE or (len(models) > 1 and rng.random() < 0.5):
            models.pop(rng.randrange(len(models)))
        else:
            models.append(scanned_model(rng, MODELS_PER_NODE + beat).to_dict())


def fleet_kinds(n: int, seed: int) -> list[str]:
    """Node kinds of agents 0..n-1 in the FLEET_MIX proportions (seeded)."""
    rng = random.Random(seed)
    return rng.choices([k for k, _ in FLEET_MIX], weights=[w for _, w in FLEET_MIX], k=n)


# -- figures --------------------------------------------------------------------------
def held(steps: list[dict[str, Any]]) -> int:
    """The largest N of a step with p99 under the limit and no error (0: none)."""
    return max((s["agents"] for s in steps if step_ok(s)), default=0)


def step_ok(step: dict[str, Any]) -> bool:
    errors = step["errors"] + step.get("errors_in_warmup", 0)
    return bool(step["beats"]) and step["p99_ms"] < P99_LIMIT_MS and errors == 0


def parse_cpus(text: str) -> list[int]:
    """``0,2-3`` -> [0, 2, 3]."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return sorted(set(out))


def parse_pin(
    pin: str, cpus: list[int], servers: int = 1
) -> tuple[list[int] | None, list[int] | None]:
    """(server CPUs, load CPUs) for ``--pin``; None = not pinned. ``auto`` pins only when
    every server and the load generator can have a CPU of their own: the servers share
    all CPUs but the last, the load generator has the last."""
    if pin == "none":
        return None, None
    if pin == "auto":
        return (cpus[:-1], cpus[-1:]) if len(cpus) > servers else (None, None)
    server, sep, load = pin.partition(":")
    if not sep or not server or not load:
        raise ValueError(f"--pin {pin!r}: auto, none or SERVER_CPUS:LOAD_CPUS (e.g. 0:1)")
    return parse_cpus(server), parse_cpus(load)


def by_worker(samples: list[Any]) -> list[list[float]]:
    """Per server worker (``x-heteroflow-worker``): [beats answered, their p99 ms], most
    beats first — the balance, and whether one worker's tail is the step's; empty when
    no answer named a worker (one process per server)."""
    lat: dict[int, list[float]] = {}
    for x in samples:
        if x.ok and x.worker:
            lat.setdefault(x.worker, []).append(x.latency_s * 1000)
    per = [[len(v), round(percentile(v, 99), 2)] for v in lat.values()]
    return sorted(per, reverse=True)


# -- processes --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_server(
    db_url: str, workdir: Path, index: int, cpus: list[int] | None,
    extra_env: dict[str, str] | None = None, workers: int = 1,
) -> Server:
    """``heteroflow server`` (``--workers``) on a free port, pinned to ``cpus``; waits
    until it says it listens (every worker ready) and answers /healthz."""
    port = free_port()
    log = workdir / f"server{index}.log"
    env = {
        **os.environ,
        "HETEROFLOW_DATABASE_URL": db_url,
        "HETEROFLOW_DATA_DIR": str(workdir / f"server{index}"),
        "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_ADMIN_PASSWORD": "bench-admin-password",
        **({"HETEROFLOW_REDIS_URL": REDIS_URL} if workers > 1 else {}),
        **(extra_env or {}),
    }
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    argv = [sys.executable, "-m", "heteroflow.cli", "server", "--port", str(port)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, preexec_fn=pin,
        )
    srv = Server(f"http://127.0.0.1:{port}", popen, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise SystemExit(f"server {index} exited ({popen.returncode}):\n{srv.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            said = "listening on" in log.read_text(errors="replace")
            if said and httpx.get(srv.url + "/healthz", timeout=1).status_code == 200:
                return srv
        time.sleep(0.2)
    srv.stop()
    raise SystemExit(f"server {index} did not answer /healthz in 60 s:\n{srv.tail()}")


class CpuMeter:
    """User+system CPU seconds of the server processes (each with its workers: the
    process tree, read at every call) and of the PostgreSQL backends serving ``db_name``
    (each backend counted from when it is first seen)."""

    def __init__(self, pids: list[int], db_name: str) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.db_name = db_name
        self.admin = psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)
        self.seen: dict[int, psutil.Process] = {}

    def close(self) -> None:
        self.admin.close()

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)

    def server_s(self) -> float:
        total = 0.0
        for p in self.procs:
            total += self._cpu(p)
            with contextlib.suppress(psutil.Error):
                total += sum(self._cpu(c) for c in p.children(recursive=True))
        return total

    def first_worker(self, index: int = 0) -> int:
        """The pid serving requests for server ``index``: itself, or its first worker."""
        proc = self.procs[index]
        with contextlib.suppress(psutil.Error):
            children = proc.children()
            if children:
                return int(min(c.pid for c in children))
        return int(proc.pid)

    def pg_s(self) -> dict[int, float]:
        rows = self.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", (self.db_name,)
        ).fetchall()
        out = {}
        for (pid,) in rows:
            if pid not in self.seen:
                with contextlib.suppress(psutil.Error):
                    self.seen[pid] = psutil.Process(pid)
            if pid in self.seen:
                out[pid] = self._cpu(self.seen[pid])
        return out


# -- load -------------------------------------------------------------------------------
@dataclass(slots=True)
class Sample:
    sent: float  # loop time the request was sent
    latency_s: float
    ok: bool
    lag_s: float  # how late the agent woke for it
    worker: int = 0  # the pid of the server worker that answered (--workers), else 0


@dataclass
class Load:
    samples: list[Sample] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        kind = what.split(":", 1)[0]
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        if len(self.first_errors) < 5:
            self.first_errors.append(what[:300])


async def agent(
    url: str, body: dict[str, Any], seed: int, phase_s: float, load: Load, stop: asyncio.Event
) -> None:
    """One simulated agent: its own connection, a heartbeat every INTERVAL_S."""
    rng = random.Random(seed)
    clock = time.perf_counter  # uvloop's loop.time() has 1 ms steps
    headers = {"Authorization": f"Bearer {NODE_TOKEN}", "Content-Type": "application/json",
               "X-Heteroflow-Node": ""}
    conn = aiohttp.TCPConnector(limit=1, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    beat = 0
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        due = clock() + phase_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, due - clock()))
            if stop.is_set():
                return
            lag = clock() - due
            if beat:
                churn(body, rng, beat)
            data = orjson.dumps(body)
            t0 = clock()
            ok = False
            worker = 0
            try:
                async with http.post(url, data=data, headers=headers) as r:
                    reply = await r.read()
                    if r.status == 200:
                        ok = True
                        worker = int(r.headers.get(WORKER_HEADER, 0))
                        if not headers["X-Heteroflow-Node"]:
                            headers["X-Heteroflow-Node"] = orjson.loads(reply)["node_id"]
                    else:
                        load.error(f"http {r.status}: {reply[:200]!r}")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                load.error(f"{type(exc).__name__}: {exc}")
            load.samples.append(Sample(t0, clock() - t0, ok, lag, worker))
            beat += 1
            due += beat_pause(INTERVAL_S, rng.random)  # the agent's own pause, jitter and all
            now = clock()
            if due < now:  # a beat that took longer than the interval: skip the missed slots
                due += INTERVAL_S * (int((now - due) / INTERVAL_S) + 1)


def py_spy(
    out: Path | None, pid: int, agents: int, seconds: float, workers: int = 1
) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of the first server for one step's window (``--profile``):
    collapsed stacks of every thread, including the time they wait on the GIL."""
    if out is None:
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    of = f"-{workers}-workers" if workers > 1 else ""  # the first worker's
    dest = out / f"server0{of}-{agents}-agents.txt"
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
         "--gil", "--format", "raw", "--output", str(dest)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


async def pg_cpu_during(meter: CpuMeter, seconds: float) -> float:
    """CPU seconds the PostgreSQL backends of the bench database used over ``seconds``,
    looked at every 0.5 s (a backend that exits loses at most its last half second)."""
    first = await asyncio.to_thread(meter.pg_s)
    last = dict(first)
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        await asyncio.sleep(min(0.5, left))
        for pid, used in (await asyncio.to_thread(meter.pg_s)).items():
            first.setdefault(pid, 0.0)  # started meanwhile: all of it is in the window
            last[pid] = used
    return sum(last[pid] - first[pid] for pid in last)


async def run_ramp(
    servers: list[Server], steps: list[int], step_s: float, meter: CpuMeter, seed: int,
    profile: Path | None = None, spread_s: float = INTERVAL_S, workers: int = 1,
) -> list[dict[str, Any]]:
    me = psutil.Process()
    load = Load()
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    kinds = fleet_kinds(max(steps), seed)
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    warmup_s = INTERVAL_S + 5.0
    try:
        for n in steps:
            started = time.perf_counter()
            gc.unfreeze()
            for i in range(len(tasks), n):
                name = f"bench-{i:05d}"
                body = agent_heartbeat(kinds[i], name, rng).model_dump()
                url = servers[i % len(servers)].url + HEARTBEAT_PATH
                tasks.append(asyncio.create_task(
                    agent(url, body, seed * 100_003 + i, rng.uniform(0, spread_s), load, stop)
                ))
            gc.collect()
            gc.freeze()  # the bodies live to the end: no full collection walks them again
            print(f"-- {n:,} agents on {len(servers)} server(s) x {workers} worker(s): "
                  f"warm-up {warmup_s:.0f} s, measure {step_s:.0f} s",
                  file=sys.stderr, flush=True)
            await asyncio.sleep(warmup_s)
            spy = py_spy(profile, meter.first_worker(0), n, step_s, workers)
            t0, cpu0, me0 = time.perf_counter(), meter.server_s(), me.cpu_times()
            pg_s = await pg_cpu_during(meter, step_s)
            t1, cpu1, me1 = time.perf_counter(), meter.server_s(), me.cpu_times()
            if spy is not None:
                await asyncio.to_thread(spy.wait)
            window = [x for x in load.samples if t0 <= x.sent < t1]
            lat = [x.latency_s * 1000 for x in window if x.ok]
            errors = sum(1 for x in window if not x.ok)
            beats = len(lat)
            load_cpu = (me1.user + me1.system - me0.user - me0.system) / (t1 - t0)
            step = {
                "agents": n,
                "beats": beats,
                "beats_per_s": round(beats / (t1 - t0), 1),
                "p50_ms": round(percentile(lat, 50), 2),
                "p99_ms": round(percentile(lat, 99), 2),
                "max_ms": round(max(lat, default=0.0), 2),
                "errors": errors,
                "errors_in_warmup": sum(1 for x in load.samples
                                        if started <= x.sent < t0 and not x.ok),
                "server_cpu_ms_per_beat": round((cpu1 - cpu0) * 1000 / beats, 3) if beats else None,
                "server_cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
                "pg_cpu_ms_per_beat": round(pg_s * 1000 / beats, 3) if beats else None,
                "load_cpu_pct": round(100 * load_cpu, 1),
                "loop_lag_p99_ms": round(percentile([x.lag_s * 1000 for x in window], 99), 2),
                # --workers: [beats, p99 ms] of each worker, most beats first
                "beats_p99_by_worker": by_worker(window),
            }
            out.append(step)
            print("   " + " ".join(f"{k}={v}" for k, v in step.items() if k != "agents"),
                  file=sys.stderr, flush=True)
            for e in load.first_errors:
                print(f"   error: {e}", file=sys.stderr)
            load.first_errors.clear()
            if not step_ok(step):
                break
            load.samples = [x for x in load.samples if x.sent >= t1]  # keep memory flat
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def _loop_factory() -> Any:
    """uvloop when installed (less of this process's CPU per request), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def idle_cpu_pct(meter: CpuMeter, seconds: float) -> float:
    a = meter.server_s()
    time.sleep(seconds)
    return round(100 * (meter.server_s() - a) / seconds, 1)


def run_phase(
    n_servers: int, steps: list[int], step_s: float, seed: int,
    pin: tuple[list[int] | None, list[int] | None], cpus: list[int], workdir: Path,
    profile: Path | None = None, server_env: dict[str, str] | None = None,
    spread_s: float = INTERVAL_S, workers: int = 1,
) -> dict[str, Any]:
    server_cpus, load_cpus = pin
    # this process (threads it starts later inherit it; the last phase's are gone)
    os.sched_setaffinity(0, load_cpus or cpus)
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    with fresh_database() as db_url:
        servers: list[Server] = []
        try:
            for i in range(n_servers):  # one at a time: the first migrates the database
                servers.append(
                    start_server(db_url, workdir, i, server_cpus, server_env, workers)
                )
            meter = CpuMeter([s.popen.pid for s in servers], db_url.rsplit("/", 1)[1])
            try:
                idle = idle_cpu_pct(meter, 5.0)
                with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                    ramp = runner.run(
                        run_ramp(servers, steps, step_s, meter, seed, profile, spread_s,
                                 workers)
                    )
                # the agents are gone, their nodes still online: what the server spends
                # on a fleet of that size without a single heartbeat (controllers)
                fleet_only = idle_cpu_pct(meter, 5.0)
            finally:
                meter.close()
            for i, s in enumerate(servers):
                if s.popen.poll() is not None:
                    print(f"server {i} died:\n{s.tail()}", file=sys.stderr)
        finally:
            for s in servers:
                s.stop()
    return {"servers": n_servers, "workers": workers, "idle_server_cpu_pct": idle,
            "steps": ramp,
            "held": held(ramp), "no_beats_cpu_pct": fleet_only,
            "no_beats_nodes": max((x["agents"] for x in ramp), default=0),
            "server_cpus": server_cpus, "load_cpus": load_cpus,
            "loadavg_start": loadavg_start,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def at_held(phase: dict[str, Any]) -> dict[str, Any]:
    return next((s for s in phase["steps"] if s["agents"] == phase["held"]), {})


def report(phases: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    cols = ("agents", "beats_per_s", "p50_ms", "p99_ms", "max_ms", "errors",
            "server_cpu_ms_per_beat", "server_cpu_pct", "pg_cpu_ms_per_beat", "load_cpu_pct",
            "loop_lag_p99_ms")
    out: dict[str, Any] = dict(meta)
    for ph in phases:
        n, w = ph["servers"], ph.get("workers", 1)
        pinned = (f"servers on CPU {ph['server_cpus']}, load on CPU {ph['load_cpus']}"
                  if ph["load_cpus"] else "nothing pinned")
        print(f"\n{n} server(s) x {w} worker(s) ({pinned}; load average "
              f"{ph['loadavg_start'][0]} at the start, {ph['loadavg_end'][0]} at the end)")
        print(f"idle server CPU {ph['idle_server_cpu_pct']}%, "
              f"{ph['no_beats_cpu_pct']}% with {ph['no_beats_nodes']:,} nodes and no "
              f"heartbeats; held: {ph['held']:,} agents at p99 < {P99_LIMIT_MS:.0f} ms")
        print("  ".join(f"{c:>12}" for c in cols))
        for s in ph["steps"]:
            mark = "" if step_ok(s) else "  <- over"
            print("  ".join(f"{s[c]!s:>12}" for c in cols) + mark)
        h = at_held(ph)
        key = phase_key(n, w)
        out[f"held_agents_{key}"] = ph["held"]
        out[f"p50_ms_at_held_{key}"] = h.get("p50_ms")
        out[f"p99_ms_at_held_{key}"] = h.get("p99_ms")
        out[f"server_cpu_ms_per_heartbeat_{key}"] = h.get("server_cpu_ms_per_beat")
        out[f"pg_cpu_ms_per_heartbeat_{key}"] = h.get("pg_cpu_ms_per_beat")
        out[f"idle_server_cpu_pct_{key}"] = ph["idle_server_cpu_pct"]
        out[f"no_beats_cpu_pct_{key}"] = ph["no_beats_cpu_pct"]
        out[f"no_beats_nodes_{key}"] = ph["no_beats_nodes"]
        for what in ("server_cpus", "load_cpus", "loadavg_start", "loadavg_end"):
            out[f"{what}_{key}"] = ph[what]
        out[f"steps_{key}"] = ph["steps"]
        cores = len(ph["load_cpus"] or ()) or meta["cpus"]
        peak = max((s["load_cpu_pct"] for s in ph["steps"]), default=0.0)
        out[f"load_cpu_pct_peak_{key}"] = peak
        out[f"load_generator_saturated_{key}"] = peak >= 90.0 * cores
        if peak >= 90.0 * cores:
            print(f"\nWARNING: the load generator used {peak}% CPU at its peak: latencies "
                  "at that step are partly its own", file=sys.stderr)
    ones = [ph for ph in phases if ph["servers"] == 1]
    # met by one server, with whichever worker count held it
    out["target_2000_agents_p99_50ms_one_server"] = (
        any(ph["held"] >= 2000 for ph in ones) if ones else None
    )
    out["held_agents_one_server_by_workers"] = {
        str(ph.get("workers", 1)): ph["held"] for ph in ones
    }
    return out


def phase_key(servers: int, workers: int = 1) -> str:
    """The JSON keys' suffix: ``1_server``, ``2_servers``, ``1_server_2_workers``."""
    key = f"{servers}_server" + ("s" if servers > 1 else "")
    return key + (f"_{workers}_workers" if workers > 1 else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", default="250,500,1000,2000,3000",
                    help="agent counts to ramp through, comma separated")
    ap.add_argument("--step-s", type=float, default=35.0, help="measured seconds per step")
    ap.add_argument("--servers", default="1,2", help="server counts to run the ramp with")
    ap.add_argument("--workers", default="1",
                    help="worker counts of each server (heteroflow server --workers N), "
                         "comma separated: every server count runs with each")
    ap.add_argument("--pin", default="auto",
                    help="auto | none | SERVER_CPUS:LOAD_CPUS (e.g. 0:1); default %(default)s")
    ap.add_argument("--quick", action="store_true", help="100, 250, 500 agents, 10 s steps")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra HETEROFLOW_* setting for the servers (repeatable)")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="py-spy record the first server of the one-server ramp at each "
                         "step into DIR (collapsed stacks; needs py-spy)")
    ap.add_argument("--spread-s", type=float, default=INTERVAL_S, metavar="S",
                    help="the agents' phases, uniform in [0, S): below the interval their "
                         "beats come in bursts, as after a stall of the server that every "
                         "agent waited through (default %(default)s: spread evenly)")
    args = ap.parse_args(argv)
    if not 0 < args.spread_s <= INTERVAL_S:
        ap.error(f"--spread-s must be in (0, {INTERVAL_S}]")
    steps = [100, 250, 500] if args.quick else [int(n) for n in args.steps.split(",") if n]
    step_s = 10.0 if args.quick else args.step_s
    counts = [1] if args.quick else [int(n) for n in args.servers.split(",") if n]
    worker_counts = [int(n) for n in args.workers.split(",") if n]
    if not steps or not counts or min(steps) < 1 or min(counts) < 1:
        ap.error("--steps and --servers need positive counts")
    if not worker_counts or min(worker_counts) < 1:
        ap.error("--workers needs positive counts")
    server_env = dict(kv.split("=", 1) for kv in args.server_env if "=" in kv)
    if len(server_env) != len(args.server_env):
        ap.error("--server-env takes NAME=VALUE")
    cpus = sorted(os.sched_getaffinity(0))
    try:
        pins = {(n, w): parse_pin(args.pin, cpus, n * w) for n in counts for w in worker_counts}
    except ValueError as exc:
        ap.error(str(exc))
    meta = {
        "cpus": len(cpus),
        "pin": args.pin,
        "server_env": server_env,
        "interval_s": INTERVAL_S,
        "p99_limit_ms": P99_LIMIT_MS,
        "step_s": step_s,
        "spread_s": args.spread_s,
    }
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    phases = []
    with tempfile.TemporaryDirectory(prefix="hf-cp-bench-") as tmp:
        for n in counts:
            for w in worker_counts:
                profile = args.profile if n == 1 else None
                phases.append(
                    run_phase(
                        n, steps, step_s, args.seed, pins[n, w], cpus, Path(tmp), profile,
                        server_env, args.spread_s, w,
                    )
                )
    print(json.dumps(report(phases, meta)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
