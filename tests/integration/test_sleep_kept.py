"""An engine kept asleep (F1, F2 with vLLM's sleep mode; core.engines.sleep).

An in-process ``Agent`` with the real ``ProcessRuntime`` and the real API: an engine
launched with ``--enable-sleep-mode`` is put to sleep with ``POST /sleep?level=1`` and kept
running (the same process), the task's status says so, later heartbeats leave it alone,
and its wake is ``POST /wake_up`` on the same process — no relaunch. A node short of
memory, a sleep route that fails, and a card lent to training stop the engine instead.
The engine is a small HTTP server with vLLM's sleep routes and their state (the real
vLLM's routes are exercised in tests/e2e/test_vllm_real.py).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.daemon import Agent
from heteroflow.agent.launch import host_port_for
from heteroflow.agent.load_progress import ModelSize
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.schemas.nodes import TaskAssignment
from tests.conftest import free_port

from .conftest import Api, service_body
from .test_sleep_wake_agent import (
    CHECK,
    EngineLauncher,
    RecordingLauncher,
    alive,
    assignment,
    make_agent,
    runtime,  # noqa: F401 - the fixture
    task,
    until_running,
)

# vLLM's sleep routes with their state; each call is appended to the file argv[2]
SLEEPY_ENGINE = """
import http.server, json, sys
calls, state = sys.argv[2], {"sleeping": False, "fail": sys.argv[3] == "fail"}
class Engine(http.server.BaseHTTPRequestHandler):
    def answer(self, status, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/is_sleeping":
            return self.answer(200, {"is_sleeping": state["sleeping"]})
        self.answer(200)
    def do_POST(self):
        with open(calls, "a") as f:
            f.write(self.path + " " + self.headers.get("authorization", "") + "\\n")
        if state["fail"]:
            return self.answer(500, {"error": "CUDA out of memory"})
        if self.path.startswith("/sleep"):
            state["sleeping"] = True
        elif self.path == "/wake_up":
            state["sleeping"] = False
        self.answer(200)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Engine).serve_forever()
"""


class SleepyLauncher(EngineLauncher):
    """Launches the engine above with vLLM's sleep-mode flag in its argv, as the recipe
    does for vLLM on CUDA cards (the agent keys on the launch's flag)."""

    def __init__(self, rt: ProcessRuntime, calls: Path) -> None:
        super().__init__(rt)
        self.calls = calls
        self.fail = False

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        argv = (
            sys.executable, "-c", SLEEPY_ENGINE, str(host_port_for(t)), str(self.calls),
            "fail" if self.fail else "ok", "--enable-sleep-mode",
        )
        self.runtime.start(LaunchSpec(t.id, argv))
        self.launched.append(argv)
        return argv


def calls_of(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line.split(" ", 1)[0] for line in path.read_text().splitlines()]


async def started(api: Api, agent: Agent, admin: dict[str, str]) -> str:
    await agent.tick()  # registers the node
    r = api.client.post("/api/v1/task-groups", json=service_body(health_check=CHECK), headers=admin)
    task_id = str(r.json()["tasks"][0]["id"])
    api.app.scheduler.run_round()
    await agent.tick()  # claims and launches
    await until_running(api, agent, admin, task_id)
    return task_id


async def closed(agent: Agent) -> None:
    await agent.client.aclose()
    if agent._http is not None:
        await agent._http.close()


@pytest.mark.feature("F1", "F2")
def test_an_engine_with_sleep_mode_is_kept_asleep_and_woken_in_place(
    api: Api, tmp_path: Path, runtime: ProcessRuntime  # noqa: F811
) -> None:
    admin = api.login()
    calls = tmp_path / "calls"
    launcher = SleepyLauncher(runtime, calls)
    agent = make_agent(api, tmp_path, launcher)

    async def drive() -> None:
        try:
            task_id = await started(api, agent, admin)
            pid = runtime.pid(task_id)
            api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=admin)
            await agent.tick()
            assert alive(pid), "an engine with sleep mode was stopped, not kept asleep"
            assert calls_of(calls) == ["/sleep?level=1"]
            assert agent.asleep[task_id].kept and task_id not in agent.local
            key = agent.asleep[task_id].task.engine_key
            assert key and f"Bearer {key}" in calls.read_text()  # the engine's own key
            t = task(api, admin, task_id)
            assert t["status"] == "sleeping"
            assert t["status_message"].startswith("asleep: engine kept asleep (vLLM sleep mode")
            for _ in range(3):  # later looks leave a kept engine alone
                await agent.tick()
                await agent.watch_once()
            assert calls_of(calls) == ["/sleep?level=1"] and alive(pid)
            assert agent.outbox == {}

            r = api.client.post(f"/api/v1/tasks/{task_id}/wake", headers=admin)
            assert r.json()["branch"] == "waking"
            await agent.tick()
            assert calls_of(calls)[-1] == "/wake_up"
            assert len(launcher.launched) == 1, "a kept engine was launched again at wake"
            await until_running(api, agent, admin, task_id)
            assert runtime.pid(task_id) == pid and not agent.local[task_id].kept
        finally:
            await closed(agent)

    asyncio.run(drive())


@pytest.mark.feature("F1")
def test_a_node_short_of_memory_stops_the_engine_and_says_why(
    api: Api, tmp_path: Path, runtime: ProcessRuntime, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    admin = api.login()
    calls = tmp_path / "calls"
    launcher = SleepyLauncher(runtime, calls)
    agent = make_agent(api, tmp_path, launcher)
    gib = 1024**3
    monkeypatch.setattr(
        "heteroflow.agent.sleep_wake.model_size", lambda *a: ModelSize(16 * gib, None)
    )
    agent.host_memory = lambda: 8 * gib  # half of what its weights need

    async def drive() -> None:
        try:
            task_id = await started(api, agent, admin)
            pid = runtime.pid(task_id)
            api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=admin)
            await agent.tick()
            assert not alive(pid) and not agent.asleep[task_id].kept
            assert "/sleep?level=1" not in calls_of(calls)
            message = task(api, admin, task_id)["status_message"]
            assert message.startswith("asleep: engine stopped (the host's free memory"), message
            assert "a wake loads the model again" in message
            api.client.post(f"/api/v1/tasks/{task_id}/wake", headers=admin)
            await agent.tick()
            assert len(launcher.launched) == 2  # started again, as any stopped engine
            await until_running(api, agent, admin, task_id)
        finally:
            await closed(agent)

    asyncio.run(drive())


@pytest.mark.feature("F1")
def test_a_failing_sleep_route_stops_the_engine_instead(
    api: Api, tmp_path: Path, runtime: ProcessRuntime  # noqa: F811
) -> None:
    admin = api.login()
    calls = tmp_path / "calls"
    launcher = SleepyLauncher(runtime, calls)
    launcher.fail = True
    agent = make_agent(api, tmp_path, launcher)

    async def drive() -> None:
        try:
            task_id = await started(api, agent, admin)
            pid = runtime.pid(task_id)
            api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=admin)
            await agent.tick()
            assert not alive(pid)
            message = task(api, admin, task_id)["status_message"]
            assert "vLLM's sleep failed: /sleep answered HTTP 500" in message, message
        finally:
            await closed(agent)

    asyncio.run(drive())


@pytest.mark.feature("F5")
def test_a_card_lent_to_training_stops_the_engine_kept_asleep_on_it(
    api: Api, tmp_path: Path, runtime: ProcessRuntime  # noqa: F811
) -> None:
    calls = tmp_path / "calls"
    launcher = SleepyLauncher(runtime, calls)
    agent = make_agent(api, tmp_path, launcher)
    base: dict[str, Any] = {
        "group_id": "tg-x", "status": "sleeping", "task_type": "inference",
        "model_name": "m", "model_path": "/m", "image": "i", "engine": "vllm",
        "command": [], "engine_args": [], "env": [], "gpu_required": 1, "memory_mb": 0,
        "health_check": {},
    }
    port = {"container_port": 8000, "host_port": 21005, "from_pool": True}
    sleeper = TaskAssignment(id="task-sleeper00001", name="a", ports=[port], gpu_ids=[1], **base)
    other = TaskAssignment(id="task-sleeper00002", name="b", ports=[port], gpu_ids=[2], **base)
    trainer = TaskAssignment(
        id="task-trainer00001", name="t", ports=[], gpu_ids=[0, 1],
        **{**base, "task_type": "training", "status": "scheduled"},
    )
    for t in (sleeper, other):
        runtime.start(LaunchSpec(t.id, (sys.executable, "-c", "import time; time.sleep(60)")))
        loc = agent._local_for(t)
        loc.kept = True
        agent.asleep[t.id] = loc

    async def drive() -> None:
        try:
            await agent._free_cards(trainer)
        finally:
            await closed(agent)

    asyncio.run(drive())
    assert runtime.exit_code(sleeper.id) is not None, "the borrowed card's engine still runs"
    assert not agent.asleep[sleeper.id].kept  # its wake starts it again
    assert runtime.exit_code(other.id) is None and agent.asleep[other.id].kept
    assert calls_of(calls) == []  # nothing was asked of the engines


class AsleepVllm(http.server.BaseHTTPRequestHandler):
    """A vLLM whose engine already sleeps (kept asleep before the agent restarted)."""

    posts: list[str] = []

    def do_GET(self) -> None:
        body = json.dumps({"is_sleeping": self.path == "/is_sleeping"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        AsleepVllm.posts.append(self.path)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.feature("F1")
def test_an_agent_that_restarted_keeps_an_engine_that_already_sleeps(
    api: Api, tmp_path: Path
) -> None:
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), AsleepVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    AsleepVllm.posts = []
    launcher = RecordingLauncher()
    agent = make_agent(api, tmp_path, launcher)
    t = assignment("vllm", port)
    agent._adopt(t)  # its argv is unknown after the restart

    async def drive() -> None:
        try:
            await agent._to_sleep(t, {t.id: "running"})
        finally:
            await closed(agent)

    try:
        asyncio.run(drive())
    finally:
        server.shutdown()
        server.server_close()
    assert launcher.runtime.calls == [] and AsleepVllm.posts == []  # neither stopped nor re-slept
    assert agent.asleep[t.id].kept
