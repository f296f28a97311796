"""D1: the agent's container-level health check kills an engine that keeps failing it.

Two real engine processes (tiny HTTP servers) run under the agent's process runtime; one
answers its health check 200, the other 500. The agent's own watch loop, talking to the
real API, must stop (kill) the failing one after the threshold and fail its task with
the reason, and leave the healthy one running. Exit detection (an engine that dies by
itself) is C2's and is tested elsewhere: here both engines stay up until the agent acts.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.agent.launch import NoDoors
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.settings import AgentSettings

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


class Launcher(NoDoors):
    """The launcher surface the watch loop uses, over a real process runtime."""

    probe_host = "127.0.0.1"

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.runtime = runtime

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


class NoLogs:
    async def ship_once(self, task_ids: list[str]) -> None:
        pass

    def forget(self, task_id: str) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.mark.feature("D1")
def test_a_failing_health_check_kills_the_engine_and_fails_the_task(
    api: Api, tmp_path: Path
) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    check = {"interval_seconds": 10, "unhealthy_threshold": 3, "start_period_seconds": 30}
    made: dict[str, str] = {}
    for name in ("sick", "well"):
        r = api.client.post(
            "/api/v1/task-groups", json=service_body(name=name, health_check=check), headers=admin
        )
        assert r.status_code == 201, r.text
        made[name] = r.json()["tasks"][0]["id"]
    api.app.scheduler.run_round()
    for task_id in made.values():  # claimed and running, as the agent reports them
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
        assert r.status_code == 200, r.text
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
        assert r.status_code == 200, r.text

    runtime = ProcessRuntime(tmp_path / "agent")
    ports = {"sick": free_port(), "well": free_port()}
    for name, code in (("sick", 500), ("well", 200)):
        runtime.start(
            LaunchSpec(made[name], (sys.executable, "-c", ENGINE, str(ports[name]), str(code)))
        )
    pids = {name: runtime.pid(made[name]) for name in made}
    try:
        deadline = time.monotonic() + 20
        while not all(listening(p) for p in ports.values()):
            assert time.monotonic() < deadline, "the engines did not start listening"
            time.sleep(0.05)

        settings = AgentSettings(
            server_url="http://server", node_token=NODE_TOKEN, node_name="node-a",
            runtime="process", work_dir=tmp_path / "agent", stop_timeout_s=5,
        )
        launcher = Launcher(runtime)
        agent = Agent(
            settings, NodeConfig(), launcher, api.clock,  # type: ignore[arg-type]
            nvml=NvmlDiscovery(platform="none"),
        )
        agent.shipper = NoLogs()  # type: ignore[assignment]
        beat = {"name": "node-a", "address": "127.0.0.1", "inventory": {}}
        reply = api.agent_post(node_id, "/api/v1/agent/heartbeat", beat).json()
        for t in reply["tasks"]:
            agent._adopt(TaskAssignment.model_validate(t))
        for name, task_id in made.items():
            agent.local[task_id].port = ports[name]

        async def drive() -> int:
            await agent.client.aclose()  # its own client, swapped for one into the app
            agent.client._http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api.app.asgi),
                base_url="http://server",
                headers={"Authorization": f"Bearer {NODE_TOKEN}"},
            )
            agent.client.node_id = node_id
            rounds = 0
            try:
                while made["sick"] in agent.local and rounds < 20:
                    await agent.watch_once()
                    api.clock.advance(10)
                    rounds += 1
            finally:
                await agent.client.aclose()
                if agent._http is not None:
                    await agent._http.close()
            return rounds

        rounds = asyncio.run(drive())
        # the start period (30 s) ignores failures; then three in a row: no sooner
        assert 3 + 3 <= rounds <= 3 + 3 + 1, rounds
        sick_pid, well_pid = pids["sick"], pids["well"]
        assert sick_pid is not None and well_pid is not None
        assert not alive(sick_pid), "the failing engine was left running"
        assert alive(well_pid) and made["well"] in agent.local
        sick = api.client.get(f"/api/v1/tasks/{made['sick']}", headers=admin).json()
        assert sick["status"] == "failed"
        assert "health check failed 3 times" in sick["status_message"]
        well = api.client.get(f"/api/v1/tasks/{made['well']}", headers=admin).json()
        assert well["status"] == "running"
    finally:
        for task_id in made.values():
            runtime.stop(task_id, 5)


READY_WHEN = """
import http.server, os, sys
flag = sys.argv[2]
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if os.path.exists(flag) else 503)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.mark.feature("D5")
def test_a_starting_engine_serves_as_soon_as_it_answers_not_a_check_interval_later(
    api: Api, tmp_path: Path
) -> None:
    """The first probe of a launch comes too early (the engine is loading); the next one
    must not wait the check's 10 s interval: before its first pass an engine is probed
    every wake_probe_interval_s, as a waking one is (bench/cold_start.py found a tiny
    model routable only 10 s after launch)."""
    admin = api.login()
    node_id = api.heartbeat()
    check = {"interval_seconds": 10, "unhealthy_threshold": 3, "start_period_seconds": 30}
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(name="quick", health_check=check), headers=admin
    )
    assert r.status_code == 201, r.text
    task_id = r.json()["tasks"][0]["id"]
    api.app.scheduler.run_round()
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    assert r.status_code == 200, r.text

    runtime = ProcessRuntime(tmp_path / "agent")
    port, flag = free_port(), tmp_path / "ready"
    runtime.start(LaunchSpec(task_id, (sys.executable, "-c", READY_WHEN, str(port), str(flag))))
    try:
        deadline = time.monotonic() + 20
        while not listening(port):
            assert time.monotonic() < deadline, "the engine did not start listening"
            time.sleep(0.05)
        settings = AgentSettings(
            server_url="http://server", node_token=NODE_TOKEN, node_name="node-a",
            runtime="process", work_dir=tmp_path / "agent", stop_timeout_s=5,
            wake_probe_interval_s=0.2,
        )
        agent = Agent(
            settings, NodeConfig(), Launcher(runtime), api.clock,  # type: ignore[arg-type]
            nvml=NvmlDiscovery(platform="none"),
        )
        agent.shipper = NoLogs()  # type: ignore[assignment]
        beat = {"name": "node-a", "address": "127.0.0.1", "inventory": {}}
        reply = api.agent_post(node_id, "/api/v1/agent/heartbeat", beat).json()
        for t in reply["tasks"]:
            agent._adopt(TaskAssignment.model_validate(t))
        agent.local[task_id].port = port

        async def drive() -> list[str]:
            await agent.client.aclose()
            agent.client._http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api.app.asgi),
                base_url="http://server",
                headers={"Authorization": f"Bearer {NODE_TOKEN}"},
            )
            agent.client.node_id = node_id
            seen: list[str] = []
            try:
                await agent.watch_once()  # too early: 503, inside the start period
                seen.append(api.client.get(f"/api/v1/tasks/{task_id}", headers=admin)
                            .json()["status"])
                flag.touch()  # the engine is ready now
                api.clock.advance(0.3)  # well inside the check's 10 s interval
                await agent.watch_once()
                seen.append(api.client.get(f"/api/v1/tasks/{task_id}", headers=admin)
                            .json()["status"])
            finally:
                await agent.client.aclose()
                if agent._http is not None:
                    await agent._http.close()
            return seen

        assert asyncio.run(drive()) == ["starting", "running"]
    finally:
        runtime.stop(task_id, 5)
