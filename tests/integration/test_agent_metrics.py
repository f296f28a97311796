"""The agent's /metrics (P3): cards, engines, launches and heartbeats, on its own port.

The daemon runs against a fake server client, runtime and launcher (the surfaces it
uses); its metrics are scraped over HTTP from the port HETEROFLOW_AGENT_METRICS_PORT
opens (0 here: any free one), bound to loopback.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent import daemon, watch
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import GpuCard, NodeInventory, NvmlDiscovery
from heteroflow.agent.launch import NoDoors
from heteroflow.agent.metrics import AgentMetrics
from heteroflow.agent.runtime.protocol import LaunchFailed, PortInUse
from heteroflow.core.clock import FakeClock
from heteroflow.core.health import HealthCheckConfig
from heteroflow.schemas.nodes import Heartbeat, HeartbeatReply, TaskAssignment
from heteroflow.schemas.sleep import NodeTaskLife
from heteroflow.settings import AgentSettings

CARD = GpuCard(
    index=0, uuid="GPU-aaaa", vendor="nvidia", model="NVIDIA H200", memory_total_mb=143771,
    memory_used_mb=2048, compute_capability="9.0", mig_capable=True, mps_capable=True,
    temperature_c=41, source="nvml", utilization_pct=42,
)
_SAMPLE = re.compile(r"^(.+) (\S+)$")  # label values may hold spaces


def assignment(task_id: str, port: int) -> TaskAssignment:
    return TaskAssignment(
        id=task_id, group_id="tg-0123456789ab", name=task_id, status="scheduled",
        task_type="inference", model_name="m", model_path="/m/tiny.gguf", image="img",
        engine="llamacpp", command=[], engine_args=[], env=[],
        ports=[{"container_port": 8000, "host_port": port, "from_pool": True}],
        gpu_ids=[0], gpu_required=1, memory_mb=0,
        health_check={"interval_seconds": 10, "start_period_seconds": 600},
    )


class FakeClient:
    def __init__(self, tasks: list[TaskAssignment], fail_beats: int = 0) -> None:
        self.tasks = tasks
        self.fail_beats = fail_beats
        self.reports: list[tuple[str, str]] = []
        self.node_id = "node-1"
        self.beats: list[Heartbeat] = []

    async def heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        self.beats.append(hb)
        if self.fail_beats:
            self.fail_beats -= 1
            raise httpx.ConnectError("server away")
        return HeartbeatReply(node_id=self.node_id, tasks=list(self.tasks))

    async def claim(self, task_id: str) -> TaskAssignment:
        t = next(x for x in self.tasks if x.id == task_id)
        return t.model_copy(update={"status": "starting"})

    async def report(self, task_id: str, status: str, *args: Any, **kw: Any) -> str:
        self.reports.append((task_id, status))
        self.tasks = [t for t in self.tasks if t.id != task_id]  # the server moved on
        return status

    async def task_life(self) -> NodeTaskLife:
        return NodeTaskLife()

    async def file_requests(self) -> list[Any]:
        return []

    async def aclose(self) -> None:
        pass


class FakeRuntime:
    name = "process"

    def __init__(self) -> None:
        self.running: set[str] = set()

    def managed(self) -> dict[str, str]:
        return dict.fromkeys(self.running, "running")

    def exit_code(self, task_id: str) -> int | None:
        return None if task_id in self.running else 0

    def stop(self, task_id: str, timeout_s: float) -> None:
        self.running.discard(task_id)

    def remove(self, task_id: str) -> None:
        self.running.discard(task_id)

    def forget(self, task_id: str) -> None:
        pass


class FakeLauncher(NoDoors):
    """Launches by task id: ``ok-*`` start, ``bad-*`` fail, ``busy-*`` find the port taken."""

    probe_host = "127.0.0.1"

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        if t.id.startswith("bad"):
            raise LaunchFailed("image not found")
        if t.id.startswith("busy"):
            raise PortInUse("port 21002 is taken", (21002,))
        self.runtime.running.add(t.id)
        return ("engine", t.id)

    def engines(self) -> dict[str, str]:
        return {"llamacpp": ""}

    def observe(self, inv: NodeInventory) -> None:
        pass

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


class NoLogs:
    async def ship_once(self, task_ids: list[str]) -> None:
        pass

    def forget(self, task_id: str) -> None:
        pass


async def _never_passes(
    config: HealthCheckConfig, host: str, port: int, session: Any = None, key: str = ""
) -> tuple[bool, str]:
    return False, "not yet"


@pytest.fixture(autouse=True)
def node(monkeypatch: pytest.MonkeyPatch) -> None:
    inv = NodeInventory((CARD,), 8, 65536, 60000, 3.0, 10.0)
    monkeypatch.setattr(daemon, "collect_inventory", lambda gpus, nvml: inv)
    monkeypatch.setattr(daemon, "listening_ports", lambda: [])
    monkeypatch.setattr(watch, "probe", _never_passes)  # where the watch loop looks it up


def make(tmp_path: Path, client: FakeClient, **settings: Any) -> Agent:
    runtime = FakeRuntime()
    agent = Agent(
        AgentSettings(
            server_url="http://server", node_token="node-token-agent-metrics",
            node_name="node-a", runtime="process", work_dir=tmp_path / "agent",
            metrics_port=0, **settings,
        ),
        NodeConfig(),
        FakeLauncher(runtime),  # type: ignore[arg-type]  # the surface the daemon uses
        FakeClock(),
        nvml=NvmlDiscovery(platform="none"),
    )
    agent.client = client  # type: ignore[assignment]
    agent.shipper = NoLogs()  # type: ignore[assignment]
    agent.metrics = AgentMetrics("node-a")
    return agent


async def _bound(agent: Agent) -> int:
    deadline = time.monotonic() + 10
    while agent.metrics_port is None:
        assert time.monotonic() < deadline, "the metrics port was never bound"
        await asyncio.sleep(0.01)
    return agent.metrics_port


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            out[m[1]] = float(m[2])
    return out


async def _scrape(port: int) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


@pytest.mark.feature("P3")
def test_cards_engines_launches_and_heartbeats_are_served(tmp_path: Path) -> None:
    tasks = [assignment("ok-1", 21000), assignment("bad-1", 21001), assignment("busy-1", 21002)]
    client = FakeClient(tasks, fail_beats=1)
    agent = make(tmp_path, client)

    async def drive() -> httpx.Response:
        with pytest.raises(httpx.ConnectError):
            await agent.tick()  # the server is away: a failed heartbeat
        await agent.tick()  # claims and launches all three
        stop = asyncio.Event()
        served = asyncio.create_task(agent._serve_metrics(stop))
        try:
            return await _scrape(await _bound(agent))
        finally:
            stop.set()
            await served

    r = asyncio.run(drive())
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    s = parse(r.text)
    card = 'node="node-a",card="0",uuid="GPU-aaaa",model="NVIDIA H200"'
    assert s[f"heteroflow_agent_card_memory_used_bytes{{{card}}}"] == 2048 * 1024 * 1024
    assert s[f"heteroflow_agent_card_memory_total_bytes{{{card}}}"] == 143771 * 1024 * 1024
    assert s[f"heteroflow_agent_card_temperature_celsius{{{card}}}"] == 41
    assert s[f"heteroflow_agent_card_utilization_ratio{{{card}}}"] == 0.42
    # the same reading goes to the server with the beat (the console's card series)
    assert client.beats[-1].inventory.gpus[0].utilization_pct == 42
    assert s['heteroflow_agent_launches_total{outcome="started"}'] == 1
    assert s['heteroflow_agent_launches_total{outcome="failed"}'] == 1
    assert s['heteroflow_agent_launches_total{outcome="port_busy"}'] == 1
    assert s['heteroflow_agent_engines{engine="llamacpp",state="starting"}'] == 1
    assert s["heteroflow_agent_heartbeat_failures_total"] == 1
    assert s["heteroflow_agent_heartbeat_duration_seconds_count"] == 1
    assert ("bad-1", "failed") in client.reports and ("busy-1", "pending") in client.reports


@pytest.mark.feature("P3")
def test_the_running_agent_serves_them_on_loopback_only_when_asked(tmp_path: Path) -> None:
    client = FakeClient([], fail_beats=1_000_000)  # every heartbeat fails
    agent = make(tmp_path, client, heartbeat_interval_s=0.05)
    off = make(tmp_path, client)
    off.settings = off.settings.model_copy(update={"metrics_port": None})

    async def drive() -> tuple[httpx.Response, str]:
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        quiet = asyncio.create_task(off._serve_metrics(stop))
        try:
            port = await _bound(agent)
            r = await _scrape(port)
            assert quiet.done() and off.metrics_port is None  # not asked: nothing served
            return r, agent.settings.metrics_host
        finally:
            stop.set()
            await running

    r, host = asyncio.run(drive())
    assert host == "127.0.0.1"
    assert parse(r.text)["heteroflow_agent_heartbeat_failures_total"] >= 1
