"""A gang sleeps, wakes and idles as one (issue 32, G3) against the real API.

Two in-process ``Agent``s (nodes ``gang-a`` and ``gang-b``) with the real
``ProcessRuntime`` run the two stages of a vLLM ``pipeline`` group; cheap Python programs
stand in for vLLM (rank 0 answers its health check over HTTP, rank 1 runs headless: a
process with no port), as the gloo test's stages do. Proven: the heartbeat lists each
stage with its rank and its place in the gang (so a headless stage opens no door and is
judged by its process); the idle timer judges rank 0 alone and sleeps the gang whole;
a sleep asked of one stage puts the whole gang to sleep and
stops both processes; a request's wake (``wake_for_request``) wakes both, each
relaunched with the gang's environment (``MASTER_ADDR``/``MASTER_PORT``/``RANK``) from
the heartbeat, and the gang runs again; a gang whose stage is not running does not
sleep at all; a wake blocked on one stage's node wakes no stage and says so once.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import func, select

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.engine_door import DoorKeeper
from heteroflow.agent.inventory import NodeInventory, NvmlDiscovery
from heteroflow.agent.launch import NoDoors, host_port_for, task_env
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.core.events import EventKind
from heteroflow.db.tables import Event, Task
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.lifecycle.idle import sleep_if_idle, wake_for_request
from heteroflow.services.lifecycle.wake_retry import retry_wakes
from heteroflow.settings import AgentSettings

from .conftest import NODE_TOKEN, Api

# rank 0 serves its API (a health route); a headless stage has no port at all
SERVING = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
HEADLESS = "import time\nwhile True: time.sleep(1)\n"
CHECK = {"interval_seconds": 1, "start_period_seconds": 30, "unhealthy_threshold": 3}
GANG_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


class StageLauncher(NoDoors):
    """The process runtime with a cheap program standing in for each vLLM stage; keeps
    the gang environment each launch was given (``agent.launch.task_env``)."""

    probe_host = "127.0.0.1"

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.runtime = runtime
        self.envs: list[dict[str, str]] = []

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        env = task_env(t)
        self.envs.append({k: env.get(k, "") for k in GANG_ENV})
        if t.rank == 0:
            argv: tuple[str, ...] = (sys.executable, "-c", SERVING, str(host_port_for(t)))
        else:
            argv = (sys.executable, "-c", HEADLESS)
        self.runtime.start(LaunchSpec(t.id, argv))
        return argv

    def resume(self, t: TaskAssignment) -> tuple[str, ...]:
        return self.launch(t)

    def engines(self) -> dict[str, str]:
        return {"vllm": "cpu"}

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


def make_agent(api: Api, tmp: Path, name: str, launcher: StageLauncher) -> Agent:
    settings = AgentSettings(
        server_url="http://server",
        node_token=NODE_TOKEN,
        node_name=name,
        runtime="process",
        work_dir=tmp / name,
        stop_timeout_s=5,
    )
    agent = Agent(
        settings,
        NodeConfig(allowed_volume_prefixes=("/models",)),
        launcher,
        api.clock,
        nvml=NvmlDiscovery(platform="none"),
    )
    agent.shipper = NoLogs()  # type: ignore[assignment]
    agent.client._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api.app.asgi),
        base_url="http://server",
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    return agent


def body() -> dict[str, Any]:
    return {
        "name": "pp",
        "model_name": "tiny-pp",
        "parallelism": "pipeline",
        "world_size": 2,
        "idle_timeout_minutes": 5,
        "health_check": CHECK,
        "task": {
            "engine": "vllm",
            "image": "vllm/vllm-openai:v0.32.0",
            "gpu_required": 0,
            "model_path": "/models/tiny-hermes",
            "memory_mb": 64,
            "engine_args": ["--max-model-len", "256"],
        },
    }


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def runtimes(tmp_path: Path) -> Iterator[list[ProcessRuntime]]:
    rts = [ProcessRuntime(tmp_path / f"rt{i}") for i in range(2)]
    try:
        yield rts
    finally:
        for rt in rts:
            for task_id in rt.running():
                rt.stop(task_id, 5)


class Gang:
    def __init__(self, api: Api, agents: list[Agent], admin: dict[str, str]) -> None:
        self.api, self.agents, self.admin = api, agents, admin
        self.group_id = ""

    def stages(self) -> list[dict[str, Any]]:
        r = self.api.client.get(f"/api/v1/task-groups/{self.group_id}", headers=self.admin)
        tasks = [t for t in r.json()["tasks"] if not t.get("replaced_by")]
        return sorted(tasks, key=lambda t: t["rank"])

    def statuses(self) -> list[str]:
        return [t["status"] for t in self.stages()]

    async def tick(self) -> None:
        for a in self.agents:
            await a.tick()

    async def until(self, status: str) -> None:
        deadline = time.monotonic() + 30
        while self.statuses() != [status, status]:
            assert time.monotonic() < deadline, self.stages()
            await self.tick()
            for a in self.agents:
                await a.watch_once()
            self.api.clock.advance(1)
            await asyncio.sleep(0.05)

    def agent_of(self, task_id: str) -> Agent:
        return next(a for a in self.agents if task_id in (*a.local, *a.asleep))


def deferred_events(api: Api, group_id: str) -> int:
    with api.app.db.session() as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(Event)
                .where(Event.group_id == group_id, Event.kind == EventKind.WAKE_DEFERRED.value)
            )
            or 0
        )


@pytest.mark.feature("G3", "F1", "F2", "F3", "F4")
def test_a_gang_sleeps_whole_and_a_request_wakes_it_whole(
    api: Api, tmp_path: Path, runtimes: list[ProcessRuntime]
) -> None:
    admin = api.login()  # an operator: pipeline stages share their hosts' network
    launchers = [StageLauncher(rt) for rt in runtimes]
    agents = [
        make_agent(api, tmp_path, f"gang-{n}", la) for n, la in zip("ab", launchers, strict=True)
    ]
    gang = Gang(api, agents, admin)

    async def drive() -> None:
        try:
            await gang.tick()  # registers both nodes
            r = api.client.post("/api/v1/task-groups", json=body(), headers=admin)
            assert r.status_code == 201, r.text
            gang.group_id = r.json()["id"]
            assert api.app.scheduler.run_round().placed == 2
            await gang.until("running")
            s0, s1 = gang.stages()
            pids = {
                t["id"]: runtimes[agents.index(gang.agent_of(t["id"]))].pid(t["id"])
                for t in (s0, s1)
            }
            assert all(alive(p) for p in pids.values())

            # the heartbeat (not only the claim) lists each stage's rank and gang place
            await gang.tick()
            held = gang.agent_of(s1["id"]).local[s1["id"]].task
            assert held.rank == 1 and held.gang is not None and held.gang["rank"] == 1
            assert DoorKeeper("127.0.0.1").door_for(held) is None  # headless: no door
            head = gang.agent_of(s0["id"]).local[s0["id"]].task
            assert DoorKeeper("127.0.0.1").door_for(head) is not None  # rank 0 serves

            # a sleep asked of the headless stage puts the whole gang to sleep
            r = api.client.post(f"/api/v1/tasks/{s1['id']}/sleep", headers=admin)
            assert r.status_code == 202, r.text
            assert gang.statuses() == ["sleeping", "sleeping"]
            await gang.tick()
            assert not any(alive(p) for p in pids.values()), "a stage kept running asleep"
            for t in (s0, s1):
                assert t["id"] in gang.agent_of(t["id"]).asleep
            for _ in range(2):  # asleep without an engine is normal: nothing reported lost
                await gang.tick()
                for a in agents:
                    await a.watch_once()
            assert gang.statuses() == ["sleeping", "sleeping"]
            # a stage that exits because its peers stopped (vLLM's headless stage does)
            # before its own agent stopped it was meant to stop: asleep, not failed
            node_b = gang.agent_of(s1["id"]).client.node_id
            r = api.agent_post(
                node_b,
                f"/api/v1/agent/tasks/{s1['id']}/report",
                {
                    "status": "failed",
                    "message": "engine exited with code 1: peer gone",
                    "fault": "engine_exited",
                },
            )
            assert r.status_code == 200, r.text
            assert gang.statuses() == ["sleeping", "sleeping"]
            assert "asleep with its gang" in gang.stages()[1]["status_message"]

            # a request for the model wakes the gang whole, its environment intact
            launched = [len(la.envs) for la in launchers]
            with api.app.db.session() as s:
                outcomes = wake_for_request(s, api.clock, [gang.group_id], "tiny-pp")
            assert sorted(o.branch for o in outcomes) == ["waking", "waking"], outcomes
            assert gang.statuses() == ["waking", "waking"]
            await gang.until("running")
            relaunched = [e for la, n in zip(launchers, launched, strict=True) for e in la.envs[n:]]
            assert sorted(e["RANK"] for e in relaunched) == ["0", "1"]
            master = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in relaunched}
            assert len(master) == 1 and "" not in next(iter(master)), relaunched
            for t in (s0, s1):
                rt = runtimes[agents.index(gang.agent_of(t["id"]))]
                assert alive(rt.pid(t["id"])) and rt.pid(t["id"]) != pids[t["id"]]

            # a gang with a stage not running does not sleep at all (409 names it)
            with api.app.db.session() as s:
                s.get(Task, s1["id"]).status = "starting"  # type: ignore[union-attr]
            r = api.client.post(f"/api/v1/task-groups/{gang.group_id}/sleep", headers=admin)
            assert gang.statuses() == ["running", "starting"], r.text
            r = api.client.post(f"/api/v1/tasks/{s0['id']}/sleep", headers=admin)
            assert r.status_code == 409 and "stage 1" in r.text, r.text
            with api.app.db.session() as s:
                s.get(Task, s1["id"]).status = "running"  # type: ignore[union-attr]

            # a wake blocked on one stage's node wakes no stage, said once for the gang
            api.client.post(f"/api/v1/task-groups/{gang.group_id}/sleep", headers=admin)
            await gang.tick()
            api.clock.advance(60)  # node gang-b silent: offline, not yet lost
            await agents[0].tick()
            before = deferred_events(api, gang.group_id)
            for _ in range(2):  # the gateway may ask on every request
                with api.app.db.session() as s:
                    outcomes = wake_for_request(s, api.clock, [gang.group_id], "tiny-pp")
            assert {o.branch for o in outcomes} == {"node_offline"}, outcomes
            assert gang.statuses() == ["sleeping", "sleeping"]
            assert deferred_events(api, gang.group_id) == before + 1
            await gang.tick()  # gang-b is back: the retrier wakes the gang whole
            with api.app.db.session() as s:
                done = retry_wakes(s, api.clock, offline_after_s=20, node_lost_after_s=120)
            assert sorted(done.woken) == sorted([s0["id"], s1["id"]]), done
            await gang.until("running")

            # the idle timer judges the stage that serves: a headless stage's later
            # start keeps no gang awake, and the timer puts the gang to sleep whole
            with api.app.db.session() as s:
                late = s.get(Task, s1["id"])
                assert late is not None
                late.running_at = api.clock.now() + timedelta(minutes=4)
            api.clock.advance(5 * 60 + 1)
            with api.app.db.session() as s:
                assert sleep_if_idle(s, api.clock, gang.group_id) != []
            assert gang.statuses() == ["sleeping", "sleeping"]
        finally:
            for a in agents:
                await a.client.aclose()

    asyncio.run(drive())
