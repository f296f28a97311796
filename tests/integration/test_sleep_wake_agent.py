"""The agent's side of sleep and wake (F1, F2, D2, C2) against the real API.

An in-process ``Agent`` with the real ``ProcessRuntime`` converges on its heartbeat
replies: a task put to sleep has its engine process stopped (and is never reported
lost, nor its engine relaunched), a woken one is launched again with the same argv and
reported running at its first passing health check; a woken engine that never passes
and makes no progress fails its task once its load stalls (D5: ``load_stall_s``, never
inside its start period); a task stopped while asleep is confirmed
stopped. The engines are tiny HTTP servers (the real llama.cpp engine is the e2e
test's); the vLLM ``POST /sleep?level=2`` call is checked against a fake vLLM server.
"""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NodeInventory, NvmlDiscovery
from heteroflow.agent.launch import NoDoors, host_port_for
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.settings import AgentSettings
from tests.conftest import free_port

from .conftest import NODE_TOKEN, Api, service_body

ENGINE = """
import http.server, sys
status = int(sys.argv[2])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
CHECK = {"interval_seconds": 1, "start_period_seconds": 30, "unhealthy_threshold": 3}


class EngineLauncher(NoDoors):
    """The process runtime with a tiny engine standing in for llama.cpp."""

    probe_host = "127.0.0.1"

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.runtime = runtime
        self.status = 200  # what the engine answers its health check with
        self.launched: list[tuple[str, ...]] = []

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        argv = (sys.executable, "-c", ENGINE, str(host_port_for(t)), str(self.status))
        self.runtime.start(LaunchSpec(t.id, argv))
        self.launched.append(argv)
        return argv

    def resume(self, t: TaskAssignment) -> tuple[str, ...]:
        return self.launch(t)

    def engines(self) -> dict[str, str]:
        return {"llamacpp": ""}

    def observe(self, inv: NodeInventory) -> None:
        pass

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since

    def file_roots(self, t: TaskAssignment) -> list[str]:
        return []


class NoLogs:
    async def ship_once(self, task_ids: list[str]) -> None:
        pass

    def forget(self, task_id: str) -> None:
        pass


def make_agent(api: Api, tmp_path: Path, launcher: Any, **over: Any) -> Agent:
    settings = AgentSettings(
        server_url="http://server", node_token=NODE_TOKEN, node_name="node-a",
        runtime="process", work_dir=tmp_path / "agent", stop_timeout_s=5, **over,
    )
    agent = Agent(
        settings, NodeConfig(), launcher, api.clock, nvml=NvmlDiscovery(platform="none")
    )
    agent.shipper = NoLogs()  # type: ignore[assignment]
    agent.client._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api.app.asgi),
        base_url="http://server",
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    return agent


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def task(api: Api, admin: dict[str, str], task_id: str) -> dict[str, Any]:
    return dict(api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json())


async def until_running(api: Api, agent: Agent, admin: dict[str, str], task_id: str) -> None:
    """Watch rounds (one fake second apart) until the task is reported running (60 s of
    real time: a CI run on a busy box once took over 20 for a woken engine)."""
    deadline = time.monotonic() + 60
    while task(api, admin, task_id)["status"] != "running":
        assert time.monotonic() < deadline, task(api, admin, task_id)
        await agent.watch_once()
        api.clock.advance(1)
        await asyncio.sleep(0.05)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[ProcessRuntime]:
    rt = ProcessRuntime(tmp_path / "agent")
    try:
        yield rt
    finally:
        for task_id in rt.running():
            rt.stop(task_id, 5)


@pytest.mark.feature("F1", "F2", "D2", "C2", "D5")
def test_the_agent_stops_the_engine_for_sleep_and_relaunches_it_for_wake(
    api: Api, tmp_path: Path, runtime: ProcessRuntime
) -> None:
    admin = api.login()
    launcher = EngineLauncher(runtime)
    # D5: no fixed wake limit; a stall is judged once the 30 s start period is over
    agent = make_agent(api, tmp_path, launcher, load_stall_s=10)

    async def drive() -> None:
        try:
            await agent.tick()  # registers the node
            r = api.client.post(
                "/api/v1/task-groups", json=service_body(health_check=CHECK), headers=admin
            )
            task_id = r.json()["tasks"][0]["id"]
            api.app.scheduler.run_round()
            await agent.tick()  # claims and launches
            await until_running(api, agent, admin, task_id)
            first_pid = runtime.pid(task_id)
            assert alive(first_pid)

            r = api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=admin)
            assert r.status_code == 202, r.text
            # the light poll sees it before the next heartbeat would
            assert agent._life_wants_beat(await agent.client.task_life())
            await agent.tick()
            assert not alive(first_pid), "the engine of a sleeping task was left running"
            assert task_id not in agent.local and task_id in agent.asleep
            assert agent.asleep[task_id].tracker.paused  # D2: no probes while asleep
            assert task_id not in runtime.managed()
            for _ in range(3):  # a sleeping task without an engine is normal: no "lost"
                await agent.tick()
                await agent.watch_once()
            assert agent.outbox == {}
            assert not agent._life_wants_beat(await agent.client.task_life())
            t = task(api, admin, task_id)
            assert t["status"] == "sleeping" and len(launcher.launched) == 1

            r = api.client.post(f"/api/v1/tasks/{task_id}/wake", headers=admin)
            assert r.json()["branch"] == "waking"
            assert agent._life_wants_beat(await agent.client.task_life())
            await agent.tick()  # C2's resume branch: the same argv, launched again
            assert launcher.launched[1] == launcher.launched[0]
            loc = agent.local[task_id]
            assert loc.waking and not loc.tracker.paused
            await until_running(api, agent, admin, task_id)
            t = task(api, admin, task_id)
            assert "awake: health check passed" in t["status_message"]
            assert alive(runtime.pid(task_id)) and runtime.pid(task_id) != first_pid
            assert not agent.local[task_id].waking

            # a woken engine that never passes its check and reads nothing stalls (D5)
            api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=admin)
            await agent.tick()
            launcher.status = 500
            api.client.post(f"/api/v1/tasks/{task_id}/wake", headers=admin)
            await agent.tick()
            sick_pid = runtime.pid(task_id)
            for _ in range(40):
                await agent.watch_once()
                if task_id not in agent.local:
                    break
                api.clock.advance(1)
                await asyncio.sleep(0.02)
            t = task(api, admin, task_id)
            assert t["status"] == "failed", t
            assert t["status_message"].startswith("stalled: no progress for 30 s"), t
            assert "(its wake); last health check: HTTP 500" in t["status_message"], t
            assert not alive(sick_pid)
        finally:
            await agent.client.aclose()
            if agent._http is not None:
                await agent._http.close()

    asyncio.run(drive())


@pytest.mark.feature("F1")
def test_a_task_stopped_while_asleep_is_confirmed_stopped(
    api: Api, tmp_path: Path, runtime: ProcessRuntime
) -> None:
    admin = api.login()
    launcher = EngineLauncher(runtime)
    agent = make_agent(api, tmp_path, launcher)

    async def drive() -> None:
        try:
            await agent.tick()
            r = api.client.post(
                "/api/v1/task-groups", json=service_body(health_check=CHECK), headers=admin
            )
            task_id = r.json()["tasks"][0]["id"]
            api.app.scheduler.run_round()
            await agent.tick()
            await until_running(api, agent, admin, task_id)
            api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=admin)
            await agent.tick()
            assert task_id in agent.asleep
            r = api.client.post(f"/api/v1/tasks/{task_id}/stop", headers=admin)
            assert r.status_code == 200, r.text  # off the agent's list
            await agent.tick()
            assert task_id not in agent.asleep
            assert task(api, admin, task_id)["status"] == "stopped"
        finally:
            await agent.client.aclose()

    asyncio.run(drive())


class FakeVllm(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []
    status = 200

    def do_POST(self) -> None:
        FakeVllm.seen.append(self.path)
        self.send_response(FakeVllm.status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class RecordingRuntime:
    """Records the order of the engine side: halt after the /sleep call."""

    name = "docker"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def halt(self, task_id: str, timeout_s: float) -> None:
        self.calls.append(f"halt {task_id} after {list(FakeVllm.seen)}")

    def forget(self, task_id: str) -> None:
        pass


class RecordingLauncher(NoDoors):
    probe_host = "127.0.0.1"

    def __init__(self) -> None:
        self.runtime = RecordingRuntime()

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


def assignment(engine: str, port: int) -> TaskAssignment:
    return TaskAssignment(
        id="task-0123456789ab", group_id="tg-x", name="svc-0", status="sleeping",
        task_type="inference", model_name="m", model_path="/m", image="i", engine=engine,
        command=[], engine_args=[], env=[],
        ports=[{"container_port": 8000, "host_port": port, "from_pool": True}],
        gpu_ids=[0], gpu_required=1, memory_mb=0, health_check={},
    )


@pytest.mark.feature("F1")
@pytest.mark.parametrize(("engine", "status"), [("vllm", 200), ("vllm-mtt", 404), ("sglang", 200)])
def test_vllm_family_engines_get_sleep_level_2_before_the_stop(
    api: Api, tmp_path: Path, engine: str, status: int
) -> None:
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeVllm.seen, FakeVllm.status = [], status
    launcher = RecordingLauncher()
    agent = make_agent(api, tmp_path, launcher)
    t = assignment(engine, port)
    agent._adopt(t)

    async def drive() -> None:
        try:
            await agent._to_sleep(t, {t.id: "running"})
        finally:
            await agent.client.aclose()
            if agent._http is not None:
                await agent._http.close()

    try:
        asyncio.run(drive())
    finally:
        server.shutdown()
        server.server_close()
    if engine.startswith("vllm"):  # asked first; a 404 (sleep mode off) is skipped
        assert launcher.runtime.calls == [f"halt {t.id} after ['/sleep?level=2']"]
    else:  # other engines are simply stopped
        assert FakeVllm.seen == [] and launcher.runtime.calls == [f"halt {t.id} after []"]
    assert t.id in agent.asleep and t.id not in agent.local


@pytest.mark.feature("F1")
def test_a_vllm_engine_that_does_not_answer_sleep_is_still_stopped(
    api: Api, tmp_path: Path
) -> None:
    launcher = RecordingLauncher()
    agent = make_agent(api, tmp_path, launcher, vllm_sleep_timeout_s=0.5)
    t = assignment("vllm", free_port())  # nothing listens there
    agent._adopt(t)
    FakeVllm.seen = []

    async def drive() -> float:
        start = time.monotonic()
        try:
            await agent._to_sleep(t, {t.id: "running"})
        finally:
            await agent.client.aclose()
            if agent._http is not None:
                await agent._http.close()
        return time.monotonic() - start

    assert asyncio.run(drive()) < 3
    assert launcher.runtime.calls == [f"halt {t.id} after []"]
