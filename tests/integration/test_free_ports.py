"""P2 and issue 12: a host port is handed out only when it is free on the node.

The agent reports what listens on its host; the pool skips those ports there. A port
found taken at launch anyway (bound between two heartbeats) goes back to the server at
once and the task is placed again with another port, the cause on the task; a port this
agent's own engine may still be leaving is retried with back-off, each retry noted.
"""

from __future__ import annotations

import asyncio
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.host_ports import listening_ports
from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.agent.launch import NoDoors
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.db.tables import Task
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.agents.nodes import MAX_PORT_CONFLICTS, assignment
from heteroflow.settings import AgentSettings

from .conftest import NODE_TOKEN, Api, service_body

POOL = range(21000, 21010)  # the api fixture's pool


def task_of(api: Api, headers: dict[str, str], group_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json()["tasks"][0])


def events(api: Api, headers: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}/events", headers=headers)
    assert r.status_code == 200, r.text
    return list(r.json())


def create(api: Api, headers: dict[str, str], **over: Any) -> str:
    r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def claim(api: Api, node_id: str, task_id: str) -> None:
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    assert r.status_code == 200, r.text


def report(api: Api, node_id: str, task_id: str, body: dict[str, Any]) -> httpx.Response:
    r: httpx.Response = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", body)
    return r


@pytest.fixture
def held() -> Iterator[socket.socket]:
    """A port some other program listens on, below the kernel's ephemeral range (a test
    pool starting there must not meet the suite's own outgoing connections)."""
    s = socket.socket()
    for port in random.sample(range(12000, 19000), 200):
        try:
            s.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    else:
        s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s
    s.close()


def test_the_agent_sees_what_listens_on_its_host(held: socket.socket) -> None:
    port = held.getsockname()[1]
    assert port in listening_ports()
    with socket.socket() as bound_only:  # bound, not listening: not a listener
        bound_only.bind(("127.0.0.1", 0))
        assert bound_only.getsockname()[1] not in listening_ports()


@pytest.mark.feature("P2")
def test_the_pool_skips_ports_the_node_reports_in_use(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat(ports_in_use=[21000, 21001, 21003])
    nodes = api.client.get("/api/v1/nodes", headers=admin).json()
    assert nodes[0]["host_ports_in_use"] == [21000, 21001, 21003]
    first, second = create(api, admin, name="one"), create(api, admin, name="two")
    api.app.scheduler.run_round()
    got = [task_of(api, admin, g)["ports"][0] for g in (first, second)]
    assert sorted(p["host_port"] for p in got) == [21002, 21004]
    assert all(p["from_pool"] for p in got)  # the pool chose them: they may be chosen again
    # the next heartbeat says the others are free again: the pool may use them
    api.heartbeat(ports_in_use=[])
    third = create(api, admin, name="three")
    api.app.scheduler.run_round()
    assert task_of(api, admin, third)["ports"][0]["host_port"] == 21000
    assert node_id


@pytest.mark.feature("P2")
def test_a_port_taken_at_launch_is_placed_again_at_once_with_another(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id = create(api, admin)
    api.app.scheduler.run_round()
    t = task_of(api, admin, group_id)
    assert t["ports"][0]["host_port"] == 21000
    claim(api, node_id, t["id"])
    r = report(api, node_id, t["id"], {
        "status": "pending", "busy_ports": [21000],
        "message": "host port 21000 is already in use",
    })
    assert r.status_code == 200 and r.json()["status"] == "pending", r.text
    t = task_of(api, admin, group_id)
    assert t["status"] == "pending" and t["node_id"] is None
    assert "host port 21000 taken on node node-a at launch" in t["status_message"]
    # the node's view has the port at once, before its next heartbeat
    nodes = api.client.get("/api/v1/nodes", headers=admin).json()
    assert 21000 in nodes[0]["host_ports_in_use"]
    api.app.scheduler.run_round()
    t = task_of(api, admin, group_id)
    assert t["status"] == "scheduled" and t["ports"][0]["host_port"] == 21001
    kinds = [e["kind"] for e in events(api, admin, group_id)]
    assert kinds.count("task.port_conflict") == 1


@pytest.mark.feature("P2")
def test_ports_taken_launch_after_launch_fail_the_task_saying_why(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id = create(api, admin)
    for launch in range(1, MAX_PORT_CONFLICTS + 1):
        api.app.scheduler.run_round()
        t = task_of(api, admin, group_id)
        claim(api, node_id, t["id"])
        port = t["ports"][0]["host_port"]
        r = report(api, node_id, t["id"], {"status": "pending", "busy_ports": [port]})
        assert r.status_code == 200, r.text
        want = "pending" if launch < MAX_PORT_CONFLICTS else "failed"
        assert r.json()["status"] == want, launch
    t = task_of(api, admin, group_id)
    assert t["status"] == "failed"
    assert f"ports were taken at {MAX_PORT_CONFLICTS} launches in a row" in t["status_message"]


def test_only_pool_ports_of_a_starting_task_are_given_back(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    fixed = create(api, admin, name="fixed", task={"ports": [
        {"container_port": 8000, "host_port": 21500}
    ]})
    api.app.scheduler.run_round()
    t = task_of(api, admin, fixed)
    body = {"status": "pending", "busy_ports": [21500]}
    assert report(api, node_id, t["id"], body).status_code == 409  # not starting yet
    claim(api, node_id, t["id"])
    r = report(api, node_id, t["id"], body)
    assert r.status_code == 409 and "not ones the pool chose" in r.text  # asked for: stays
    assert task_of(api, admin, fixed)["status"] == "starting"
    # busy_ports and 'pending' go together
    assert report(api, node_id, t["id"], {"status": "pending"}).status_code == 400
    assert report(api, node_id, t["id"], {"status": "failed", "busy_ports": [1]}).status_code == 400


def test_a_launch_retry_is_noted_on_the_task(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id = create(api, admin)
    api.app.scheduler.run_round()
    t = task_of(api, admin, group_id)
    note = {"status": "starting", "message": "host port 21000 is already in use; retry 1"}
    assert report(api, node_id, t["id"], note).status_code == 409  # not claimed yet
    claim(api, node_id, t["id"])
    r = report(api, node_id, t["id"], note)
    assert r.status_code == 200 and r.json()["status"] == "starting", r.text
    t = task_of(api, admin, group_id)
    assert t["status"] == "starting" and "retry 1" in t["status_message"]
    retries = [e for e in events(api, admin, group_id) if e["kind"] == "task.launch_retry"]
    assert [e["message"] for e in retries] == [note["message"]]


class Launcher(NoDoors):
    """The real process runtime behind the launcher surface the agent uses."""

    probe_host = "127.0.0.1"

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.runtime = runtime
        self.launched: list[int] = []

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        port = int(t.ports[0]["host_port"])
        argv = (sys.executable, "-c", "import time; time.sleep(60)")
        self.runtime.start(LaunchSpec(t.id, argv, host_ports=(port,)))
        self.launched.append(port)
        return argv

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


def assigned(api: Api, task_id: str) -> TaskAssignment:
    """What the task's agent is told (as a heartbeat reply carries it)."""
    with api.app.db.session() as s:
        t = s.get(Task, task_id)
        assert t is not None
        return assignment(t, "single")


def agent_for(api: Api, tmp_path: Path, launcher: Launcher, node_id: str) -> Agent:
    settings = AgentSettings(
        server_url="http://server", node_token=NODE_TOKEN, node_name="node-a",
        runtime="process", work_dir=tmp_path / "agent", stop_timeout_s=5,
    )
    agent = Agent(
        settings, NodeConfig(), launcher, api.clock,  # type: ignore[arg-type]
        nvml=NvmlDiscovery(platform="none"),
    )
    agent.client._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api.app.asgi),
        base_url="http://server",
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    agent.client.node_id = node_id
    return agent


@pytest.mark.feature("P2", "C11")
def test_the_agent_gives_a_strangers_port_back_and_backs_off_from_its_own(
    api: Api, tmp_path: Path, held: socket.socket
) -> None:
    """A stranger holds the pool's port: the task is placed again at once with another
    (no minutes of retries). A port this agent just released: back-off, noted on the task."""
    admin = api.login()
    taken = held.getsockname()[1]
    api.app.settings.port_pool_start, api.app.settings.port_pool_end = taken, taken + 50
    api.app.scheduler.port_pool = api.app.settings.port_pool()
    node_id = api.heartbeat()  # its heartbeat has not seen the holder yet
    group_id = create(api, admin)
    api.app.scheduler.run_round()
    t = assigned(api, task_of(api, admin, group_id)["id"])
    assert t.ports[0]["host_port"] == taken
    runtime = ProcessRuntime(tmp_path / "agent")
    launcher = Launcher(runtime)
    agent = agent_for(api, tmp_path, launcher, node_id)

    async def drive() -> None:
        try:
            await agent._claim_and_start(t)  # the launch meets the stranger's port
            assert agent.retry == {}  # no back-off on a stranger's port
            api.app.scheduler.run_round()
            again = task_of(api, admin, group_id)
            assert again["status"] == "scheduled"
            assert again["ports"][0]["host_port"] not in (0, taken)
            t2 = assigned(api, again["id"])
            await agent._claim_and_start(t2)
            assert launcher.launched == [again["ports"][0]["host_port"]]
            # its own port, just released: the next launch on it backs off, noted
            await agent._stop(t2.id, "stopped", "stopped by the test")
            mine = launcher.launched[0]
            with socket.socket() as lingering:  # the engine "still leaving" the port
                lingering.bind(("127.0.0.1", mine))
                lingering.listen(1)
                g2 = create(api, admin, name="svc2")
                api.app.scheduler.run_round()
                t3 = task_of(api, admin, g2)
                assert t3["ports"][0]["host_port"] == mine  # the server saw it free
                await agent._claim_and_start(assigned(api, t3["id"]))
                assert t3["id"] in agent.retry
                noted = task_of(api, admin, g2)
                assert noted["status"] == "starting"
                assert "launch retry 1 in 1 s" in noted["status_message"]
                # still held once the back-off (~119 s) is spent: no longer a port this
                # agent is leaving, so the pool's port is given back and chosen again
                r = agent.retry[t3["id"]]
                api.clock.advance(agent.backoff.total_s + 1)
                await agent._launch(r.task, attempt=r.attempt, first_try=r.first_try)
                assert task_of(api, admin, g2)["status"] == "pending"
                # C11: a fixed port (asked for by an operator) cannot move: retried with
                # back-off, then failed saying why (placed before a heartbeat saw it)
                api.heartbeat()
                g3 = create(api, admin, name="fixed", task={"ports": [
                    {"container_port": 8000, "host_port": mine}
                ]})
                api.app.scheduler.run_round()
                t4 = task_of(api, admin, g3)
                await agent._claim_and_start(assigned(api, t4["id"]))
                r = agent.retry[t4["id"]]
                api.clock.advance(agent.backoff.total_s + 1)
                await agent._launch(r.task, attempt=r.attempt, first_try=r.first_try)
                gave_up = task_of(api, admin, g3)
                assert gave_up["status"] == "failed"
                assert "already in use (still after 120 s)" in gave_up["status_message"]
        finally:
            for task_id in list(agent.local):
                runtime.stop(task_id, 5)
            await agent.client.aclose()

    asyncio.run(drive())
    timeline = events(api, admin, group_id)
    conflict = [e for e in timeline if e["kind"] == "task.port_conflict"]
    assert len(conflict) == 1 and f"host port {taken} taken" in conflict[0]["message"]
