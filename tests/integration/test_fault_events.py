"""Group-level fault events (E2): agent faults, lost cards, lost and returning nodes."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.agent.launch import NoDoors
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.lifecycle.faults import WatchResult
from heteroflow.settings import AgentSettings

from .conftest import NODE_TOKEN, Api, service_body

A10 = {"index": 0, "vendor": "nvidia", "model": "A10", "memory_total_mb": 24576}


def events(api: Api, headers: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}/events", headers=headers)
    assert r.status_code == 200, r.text
    return list(r.json())


def faults(api: Api, headers: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    return [e for e in events(api, headers, group_id) if e["kind"].startswith("fault.")]


def watch_round(api: Api) -> WatchResult:
    """One node-watch round as the leader: the elector renews first (the node watch is
    leader-only and fences its writes with the lease's epoch)."""
    api.app.leadership.reconcile_once(api.clock.now())
    return api.app.node_watch.run_round()


def create(api: Api, admin: dict[str, str], body: dict[str, Any]) -> tuple[str, str]:
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    g = r.json()
    return str(g["id"]), str(g["tasks"][0]["id"])


def start(api: Api, node_id: str, task_id: str) -> None:
    """Claim a placed task and report it running, as its agent would."""
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text


def report(api: Api, node_id: str, task_id: str, body: dict[str, Any]) -> Any:
    return api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", body)


@pytest.mark.feature("E2")
def test_reported_fault_is_written_with_the_transition(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, task_id = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    # a fault only explains a failure
    bad = report(api, node_id, task_id, {"status": "running", "fault": "unhealthy"})
    assert bad.status_code == 400, bad.text
    assert report(api, node_id, task_id, {"status": "failed", "fault": "oom"}).status_code == 400

    message = "engine exited with code 3; last output:\nCUDA error"
    body = {"status": "failed", "message": message, "fault": "engine_exited"}
    r = report(api, node_id, task_id, body)
    assert r.status_code == 200 and r.json()["status"] == "failed"
    assert report(api, node_id, task_id, body).status_code == 200  # a retried delivery

    timeline = events(api, admin, group_id)
    found = [e for e in timeline if e["kind"] == "fault.engine_exited"]
    assert len(found) == 1
    fault = found[0]
    assert fault["group_id"] == group_id and fault["task_id"] == task_id
    assert "node-a" in fault["message"] and "code 3" in fault["message"]
    # cause, then effect, in one timeline
    kinds = [e["kind"] for e in timeline]
    failed = next(
        i
        for i, e in enumerate(timeline)
        if e["kind"] == "task_status" and e["to_status"] == "failed"
    )
    assert kinds.index("fault.engine_exited") == failed - 1


@pytest.mark.feature("E2")
def test_container_lost_and_unhealthy_kinds(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    ids = [create(api, admin, service_body(name=f"svc{i}")) for i in range(2)]
    api.app.scheduler.run_round()
    for (_, task_id), fault in zip(ids, ("container_lost", "unhealthy"), strict=True):
        start(api, node_id, task_id)
        body = {"status": "failed", "message": f"{fault} here", "fault": fault}
        assert report(api, node_id, task_id, body).status_code == 200
    assert [e["kind"] for e in faults(api, admin, ids[0][0])] == ["fault.container_lost"]
    assert [e["kind"] for e in faults(api, admin, ids[1][0])] == ["fault.unhealthy"]


@pytest.mark.feature("E2")
def test_stopping_task_that_exits_writes_no_fault(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, task_id = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    assert api.client.post(f"/api/v1/tasks/{task_id}/stop", headers=admin).status_code == 200
    body = {"status": "failed", "message": "exited", "fault": "engine_exited"}
    assert report(api, node_id, task_id, body).json()["status"] == "stopped"
    assert faults(api, admin, group_id) == []


def gpu_body(name: str) -> dict[str, Any]:
    return service_body(name=name, task={"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 1})


@pytest.mark.feature("E2")
def test_lost_card_faults_only_the_groups_placed_on_it(api: Api) -> None:
    admin = api.login()
    api.heartbeat(gpus=[A10, {**A10, "index": 1, "uuid": "GPU-b"}])
    g0, t0 = create(api, admin, gpu_body("on0"))
    g1, t1 = create(api, admin, gpu_body("on1"))
    assert api.app.scheduler.run_round().placed == 2
    cards = {
        t: api.client.get(f"/api/v1/tasks/{t}", headers=admin).json()["gpu_ids"] for t in (t0, t1)
    }
    assert sorted(cards.values()) == [[0], [1]]
    on1 = g1 if cards[t1] == [1] else g0
    on0 = g0 if on1 == g1 else g1

    api.heartbeat(gpus=[A10])  # card 1 vanished
    lost = faults(api, admin, on1)
    assert [e["kind"] for e in lost] == ["fault.gpu_lost"]
    assert "GPU 1" in lost[0]["message"] and "node-a" in lost[0]["message"]
    assert "GPU-b" in lost[0]["message"] and lost[0]["task_id"] in (t0, t1)
    assert faults(api, admin, on0) == []

    api.heartbeat(gpus=[A10])  # still missing: not a new loss
    assert len(faults(api, admin, on1)) == 1
    api.heartbeat(gpus=[])  # NVML gone: every remaining card is lost at once
    assert [e["kind"] for e in faults(api, admin, on0)] == ["fault.gpu_lost"]
    assert "GPU 0" in faults(api, admin, on0)[0]["message"]
    assert len(faults(api, admin, on1)) == 1


@pytest.mark.feature("E2")
def test_node_lost_once_and_back(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    api.heartbeat("node-idle")
    group_id, task_id = create(api, admin, service_body())
    assert api.app.scheduler.run_round().placed == 1
    task = api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()
    assert task["node_id"] == node_id
    start(api, node_id, task_id)

    assert watch_round(api).lost == []  # online: nothing to say
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    assert watch_round(api).lost == ["node-a"]  # node-idle holds no task: no fault
    assert watch_round(api).lost == []  # level-triggered: written once
    lost = faults(api, admin, group_id)
    assert [e["kind"] for e in lost] == ["fault.node_lost"]
    assert lost[0]["task_id"] == task_id
    assert (lost[0]["from_status"], lost[0]["to_status"]) == ("online", "offline")
    assert lost[0]["message"].startswith("node node-a lost")

    api.heartbeat()
    assert watch_round(api).back == ["node-a"]
    assert watch_round(api).back == []
    back = faults(api, admin, group_id)
    assert [e["kind"] for e in back] == ["fault.node_lost", "fault.node_back"]
    assert (back[1]["from_status"], back[1]["to_status"]) == ("offline", "online")
    assert "node-a back" in back[1]["message"]

    # a second loss is a new fact
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    watch_round(api)
    watch_round(api)
    kinds = [e["kind"] for e in faults(api, admin, group_id)]
    assert kinds == ["fault.node_lost", "fault.node_back", "fault.node_lost"]


@pytest.mark.feature("E2")
def test_other_tenants_cannot_read_the_timeline(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, task_id = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    body = {"status": "failed", "message": "gone", "fault": "container_lost"}
    assert report(api, node_id, task_id, body).status_code == 200
    outsider = api.member(admin, "other", "mallory")
    r = api.client.get(f"/api/v1/task-groups/{group_id}/events", headers=outsider)
    assert r.status_code == 404, r.text


class FakeRuntime:
    """Engines the test decides the fate of: exit codes by task, None = still running."""

    name = "process"

    def __init__(self, codes: dict[str, int | None]) -> None:
        self.codes = codes

    def exit_code(self, task_id: str) -> int | None:
        return self.codes.get(task_id)

    def log_tail(self, task_id: str, lines: int) -> str:
        return "CUDA error: out of memory"

    def forget(self, task_id: str) -> None:
        pass

    def stop(self, task_id: str, timeout_s: float) -> None:
        self.codes[task_id] = 143


class FakeLauncher(NoDoors):
    probe_host = "127.0.0.1"

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


class NoLogs:
    async def ship_once(self, task_ids: list[str]) -> None:
        pass

    def forget(self, task_id: str) -> None:
        pass


@pytest.mark.feature("E2")
def test_the_agent_names_its_faults_on_the_wire(api: Api, tmp_path: Path) -> None:
    """The daemon's watch loop, talking to the real API: exit, kill, failing checks."""
    admin = api.login()
    node_id = api.heartbeat()
    made = [create(api, admin, service_body(name=name)) for name in ("exits", "killed", "sick")]
    api.app.scheduler.run_round()
    for _, task_id in made:
        start(api, node_id, task_id)
    (exits, g_exits), (killed, g_killed), (sick, g_sick) = ((t, g) for g, t in made)
    runtime = FakeRuntime({exits: 3, killed: -9, sick: None})
    settings = AgentSettings(
        server_url="http://server",
        node_token=NODE_TOKEN,
        node_name="node-a",
        runtime="process",
        work_dir=tmp_path / "agent",
    )
    agent = Agent(
        settings,
        NodeConfig(),
        FakeLauncher(runtime),  # type: ignore[arg-type]  # the surface the watch loop uses
        api.clock,
        nvml=NvmlDiscovery(platform="none"),
    )
    agent.shipper = NoLogs()  # type: ignore[assignment]
    with socket.socket() as closed:  # bound, never listening: every probe is refused
        closed.bind(("127.0.0.1", 0))
        beat = {"name": "node-a", "address": "127.0.0.1", "inventory": {}}
        reply = api.agent_post(node_id, "/api/v1/agent/heartbeat", beat).json()
        for t in reply["tasks"]:
            agent._adopt(TaskAssignment.model_validate(t))
        agent.local[sick].port = closed.getsockname()[1]

        async def drive() -> None:
            await agent.client.aclose()  # its own client, swapped for one into the app
            agent.client._http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api.app.asgi),
                base_url="http://server",
                headers={"Authorization": f"Bearer {NODE_TOKEN}"},
            )
            agent.client.node_id = node_id
            try:
                for _ in range(20):  # past the start period, then three failed checks
                    await agent.watch_once()
                    if not agent.local:
                        break
                    api.clock.advance(11)
            finally:
                await agent.client.aclose()
                if agent._http is not None:
                    await agent._http.close()

        asyncio.run(drive())
    assert agent.outbox == {}
    exited = faults(api, admin, g_exits)
    assert [e["kind"] for e in exited] == ["fault.engine_exited"]
    assert "code 3" in exited[0]["message"] and "out of memory" in exited[0]["message"]
    assert [e["kind"] for e in faults(api, admin, g_killed)] == ["fault.container_lost"]
    unhealthy = faults(api, admin, g_sick)
    assert [e["kind"] for e in unhealthy] == ["fault.unhealthy"]
    assert "health check failed 3 times" in unhealthy[0]["message"]
