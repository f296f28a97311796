"""A restart of the agent (or of ``heteroflow up``) is not the services' failure (issue 26).

An in-process ``Agent`` with the real ``ProcessRuntime`` against the real API: engines
stop with their agent, and a new agent (a new runtime that knows no process) must bring
every service back on the placement it had — the same task, node and port, no fault, no
rebuild counted (E1's budget untouched) — and a sleeping one stays asleep until its
wake relaunches it (F1, F2). Both ways an agent goes away are covered: a clean shutdown
(it gives its engines back itself) and a hard kill (the new agent finds them gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.daemon import Agent
from heteroflow.agent.runtime.process import ProcessRuntime

from .conftest import Api, service_body
from .test_fault_events import events, start
from .test_recovery import recovery_round
from .test_sleep_wake_agent import CHECK, EngineLauncher, alive, make_agent, task, until_running

Runtimes = Callable[[], ProcessRuntime]


@pytest.fixture
def runtimes(tmp_path: Path) -> Iterator[Runtimes]:
    """A fresh process runtime per agent life (what a restarted agent starts with)."""
    made: list[ProcessRuntime] = []

    def new() -> ProcessRuntime:
        made.append(ProcessRuntime(tmp_path / "agent"))
        return made[-1]

    try:
        yield new
    finally:
        for rt in made:
            for task_id in rt.running():
                rt.stop(task_id, 5)


def placement(t: dict[str, Any]) -> tuple[Any, ...]:
    return (t["id"], t["node_id"], t["gpu_ids"], [p["host_port"] for p in t["ports"]])


async def close(agent: Agent) -> None:
    await agent.client.aclose()
    if agent._http is not None:
        await agent._http.close()


async def all_running(api: Api, agent: Agent, admin: dict[str, str], ids: list[str]) -> None:
    await agent.tick()  # claims and launches what is scheduled
    for task_id in ids:
        await until_running(api, agent, admin, task_id)


def assert_nothing_failed(api: Api, admin: dict[str, str], groups: list[str]) -> None:
    """No fault, no failure, no rebuild on any timeline; the recovery loop has nothing."""
    assert recovery_round(api).rebuilt == []
    for group_id in groups:
        timeline = events(api, admin, group_id)
        assert [e for e in timeline if e["kind"].startswith("fault.")] == [], timeline
        assert [e for e in timeline if e.get("to_status") == "failed"] == [], timeline


@pytest.mark.feature("E1", "F1", "F2")
def test_a_restarted_agent_starts_its_services_again_where_they_were(
    api: Api, tmp_path: Path, runtimes: Runtimes
) -> None:
    admin = api.login()

    async def drive() -> None:
        rt = runtimes()
        first = make_agent(api, tmp_path, EngineLauncher(rt))
        await first.tick()  # registers the node
        groups, ids = [], []
        for name in ("alpha", "beta", "gamma"):
            body = service_body(name=name, health_check=CHECK, task={"model_path": f"{name}.gguf"})
            r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
            assert r.status_code == 201, r.text
            groups.append(r.json()["id"])
            ids.append(r.json()["tasks"][0]["id"])
        api.app.scheduler.run_round()
        try:
            await all_running(api, first, admin, ids)
            asleep = ids[2]
            r = api.client.post(f"/api/v1/tasks/{asleep}/sleep", headers=admin)
            assert r.status_code == 202, r.text
            await first.tick()
            assert asleep in first.asleep
            before = {i: placement(task(api, admin, i)) for i in ids}
            pids = [rt.pid(i) for i in ids[:2]]
            # 1. a clean shutdown: it stops the engines and gives the tasks back itself
            await first.shutdown()
        finally:
            await close(first)
        assert not any(alive(p) for p in pids)
        assert [task(api, admin, i)["status"] for i in ids] == [
            "scheduled", "scheduled", "sleeping"
        ]
        assert "starts again on this node" in task(api, admin, ids[0])["status_message"]
        assert {i: placement(task(api, admin, i)) for i in ids} == before  # kept
        assert recovery_round(api).rebuilt == []

        rt = runtimes()
        second = make_agent(api, tmp_path, EngineLauncher(rt))
        try:
            await all_running(api, second, admin, ids[:2])
            assert asleep in second.asleep and asleep not in second.local
            assert task(api, admin, asleep)["status"] == "sleeping"
            killed = [rt.pid(i) for i in ids[:2]]
            # 2. killed hard: its engines die with it (the process runtime's death
            # signal), nothing is reported
            for i in ids[:2]:
                rt.stop(i, 5)
        finally:
            await close(second)
        assert not any(alive(p) for p in killed)
        assert [task(api, admin, i)["status"] for i in ids[:2]] == ["running", "running"]

        rt = runtimes()
        third = make_agent(api, tmp_path, EngineLauncher(rt))
        try:
            await third.tick()  # finds them gone: given back to be started again
            gone = task(api, admin, ids[0])
            assert gone["status"] == "scheduled", gone
            assert "gone when the agent came back" in gone["status_message"]
            await all_running(api, third, admin, ids[:2])
            # the sleeping one's wake relaunches it, on its node
            r = api.client.post(f"/api/v1/tasks/{asleep}/wake", headers=admin)
            assert r.json()["branch"] == "waking", r.text
            await third.tick()
            await until_running(api, third, admin, asleep)
            assert all(alive(rt.pid(i)) for i in ids)
        finally:
            await close(third)
        after = {i: task(api, admin, i) for i in ids}
        assert {i: placement(t) for i, t in after.items()} == before
        assert [t["rebuild_count"] for t in after.values()] == [0, 0, 0]
        assert [t["replaced_by"] for t in after.values()] == ["", "", ""]
        for group_id in groups:
            g = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()
            assert g["status"] == "running" and len(g["tasks"]) == 1
        assert_nothing_failed(api, admin, groups)

    asyncio.run(drive())


def test_a_given_back_report_moves_only_a_task_whose_engine_the_agent_owned(api: Api) -> None:
    """``scheduled`` comes from starting, running or waking; a task being stopped is
    stopped by it; a sleeping one (no engine to lose) is refused with 409."""
    admin = api.login()
    node_id = api.heartbeat()
    made = []
    for name in ("one", "two", "three"):
        body = service_body(name=name, task={"model_path": f"{name}.gguf"})
        r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
        assert r.status_code == 201, r.text
        made.append(r.json()["tasks"][0]["id"])
    api.app.scheduler.run_round()
    for task_id in made:
        start(api, node_id, task_id)
    running, stopping, sleeping = made
    back = {"status": "scheduled", "message": "engine process gone when the agent came back"}

    def report(task_id: str) -> Any:
        return api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", back)

    r = report(running)
    assert (r.status_code, task(api, admin, running)["status"]) == (200, "scheduled"), r.text
    assert report(running).status_code == 200  # a repeat: nothing more
    claim = api.agent_post(node_id, f"/api/v1/agent/tasks/{running}/claim", {})
    assert claim.status_code == 200, claim.text  # its own node claims it again

    api.client.post(f"/api/v1/tasks/{stopping}/stop", headers=admin)
    assert report(stopping).status_code == 200
    assert task(api, admin, stopping)["status"] == "stopped"

    api.client.post(f"/api/v1/tasks/{sleeping}/sleep", headers=admin)
    r = report(sleeping)
    assert r.status_code == 409 and task(api, admin, sleeping)["status"] == "sleeping", r.text
