"""Attacks by a tenant member on the trust boundary (issue 10), refused at the door or by
the scheduler: host ports, the host network, environment hooks, work that needs a
container on a process-runtime node, and preemption across tenants."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from heteroflow.db.tables import InferenceEndpoint, Task, TaskGroup

from .conftest import Api

H100 = {"index": 0, "vendor": "nvidia", "model": "H100", "memory_total_mb": 81920}


def job(name: str, *, priority: int = 0, **over: Any) -> dict[str, Any]:
    task = {"image": "busybox:1.36", "command": ["sleep", "3600"], "gpu_required": 1}
    task.update(over.pop("task", {}))
    return {"name": name, "task_type": "training", "priority": priority, "task": task, **over}


def rows(api: Api) -> tuple[int, int, int]:
    with api.app.db.session() as s:
        return (
            s.scalar(select(func.count()).select_from(TaskGroup)) or 0,
            s.scalar(select(func.count()).select_from(Task)) or 0,
            s.scalar(select(func.count()).select_from(InferenceEndpoint)) or 0,
        )


def refused(api: Api, who: dict[str, str], body: dict[str, Any], field: str) -> str:
    """Both the create and its dry run answer 400 naming the field; nothing is written."""
    before = rows(api)
    for path in ("/api/v1/task-groups", "/api/v1/task-groups?dry_run=true"):
        r = api.client.post(path, json=body, headers=who)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["field"] == field, r.text
    assert rows(api) == before
    return str(r.json()["error"]["message"])


def test_a_member_cannot_take_a_fixed_host_port(api: Api) -> None:
    """Attack: ``host_port: 80`` had the engine serve on port 80."""
    admin = api.login()
    member = api.member(admin, "tn-b", "bob")
    api.heartbeat(gpus=[H100])
    for port in (80, 22, 8080):
        body = job("p", task={"ports": [{"container_port": 8000, "host_port": port}]})
        msg = refused(api, member, body, "task.ports[0].host_port")
        assert "operators" in msg
    ok = job("p", task={"ports": [{"container_port": 8000, "host_port": 0}]})
    assert api.client.post("/api/v1/task-groups", json=ok, headers=member).status_code == 201
    # an operator may pin one (the platform's own edge services)
    pinned = job("q", task={"ports": [{"container_port": 8000, "host_port": 8080}]})
    assert api.client.post("/api/v1/task-groups", json=pinned, headers=admin).status_code == 201


def test_a_member_cannot_ask_for_the_host_network(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "tn-b", "bob")
    api.heartbeat("a", gpus=[H100])
    api.heartbeat("b", gpus=[H100])
    body = job("pp", parallelism="pipeline", world_size=2)
    assert "host network" in refused(api, member, body, "parallelism")
    assert api.client.post("/api/v1/task-groups", json=body, headers=admin).status_code == 201


@pytest.mark.parametrize(
    "item",
    [
        "LD_PRELOAD=/models/evil.so",
        "PYTHONWARNINGS=ignore::0:os.system('id'):0",
        "BROWSER=/bin/sh -c 'id'",
        "https_proxy=http://attacker:3128",
        "HETEROFLOW_ADMIN_PASSWORD=x",
        "NOT_AN_ENGINE_KNOB=1",
    ],
)
def test_env_hooks_are_refused_at_create_naming_the_item(api: Api, item: str) -> None:
    """Attack: ``task.env`` reached the engine unfiltered (a shell through Python's
    warnings filter, a library through the loader)."""
    admin = api.login()
    member = api.member(admin, "tn-b", "bob")
    api.heartbeat(gpus=[H100])
    body = job("e", task={"env": ["NCCL_DEBUG=INFO", item]})
    refused(api, member, body, "task.env[1]")
    refused(api, admin, body, "task.env[1]")  # operators too: the rule is the platform's


def test_an_operator_extends_the_env_allow_list_by_setting(api: Api) -> None:
    admin = api.login()
    api.heartbeat(gpus=[H100])
    body = job("e", task={"env": ["MY_APP_MODE=fast"]})
    assert api.client.post("/api/v1/task-groups", json=body, headers=admin).status_code == 400
    api.app.settings.task_env_allow = "MY_APP_*, LD_PRELOAD"
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    # the deny-list cannot be lifted, even by naming it
    bad = job("f", task={"env": ["LD_PRELOAD=/x.so"]})
    assert api.client.post("/api/v1/task-groups", json=bad, headers=admin).status_code == 400


def test_work_that_needs_a_container_never_lands_on_a_process_runtime_node(api: Api) -> None:
    """Attack: a ``container`` task's command ran on the host as root under ``up``. Where
    every node the member may use runs the process runtime, the create (and its dry run)
    refuses it with 400 naming the field (issue 26: not a 201 that waits for ever); with a
    Docker node registered it is accepted, and the scheduler never places it on the
    process-runtime node (the reason names the runtime)."""
    admin = api.login()
    member = api.member(admin, "tn-b", "bob")
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": "proc-node",
            "address": "127.0.0.1",
            "runtime": "process",
            "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384,
                          "memory_available_mb": 16384},
        },
        headers={"Authorization": "Bearer node-token-for-tests"},
    )
    assert r.status_code == 200, r.text
    body = {
        "name": "shell",
        "task_type": "container",
        "task": {"image": "busybox:1.36", "command": ["/bin/sh", "-c", "id; env"],
                 "gpu_required": 0},
    }
    for url in ("/api/v1/task-groups?dry_run=true", "/api/v1/task-groups"):
        got = api.client.post(url, json=body, headers=member)
        assert got.status_code == 400, got.text
        err = got.json()["error"]
        assert err["field"] == "task.command" and "process runtime" in err["message"], err
    assert api.client.get("/api/v1/task-groups", headers=member).json() == []
    api.heartbeat("docker-node", memory_mb=4096)  # the test helper's nodes run Docker
    plan = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=member).json()
    assert plan["tasks"][0]["placement"]["node_name"] == "docker-node"
    g = api.client.post("/api/v1/task-groups", json=body, headers=member).json()
    # the Docker node is full: the task waits, and the process node says why not there
    api.heartbeat("docker-node", memory_mb=0)
    api.app.scheduler.run_round()
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=member).json()
    assert t["status"] == "pending"
    assert "process runtime" in t["status_message"], t["status_message"]
    api.heartbeat("docker-node")
    api.app.scheduler.run_round()
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=member).json()
    assert t["status"] == "scheduled" and t["node_id"] != r.json()["node_id"]


def run(api: Api, node_id: str, task_id: str) -> None:
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text


def running_victim(api: Api, admin: dict[str, str]) -> tuple[str, str, dict[str, str]]:
    """Tenant A's running priority-0 service on the only card; returns (node, task, A)."""
    a = api.member(admin, "tn-a", "alice")
    node = api.heartbeat(gpus=[H100])
    victim = api.client.post("/api/v1/task-groups", json=job("a-svc"), headers=a).json()
    api.app.scheduler.run_round()
    run(api, node, victim["tasks"][0]["id"])
    return node, victim["tasks"][0]["id"], a


def test_a_members_priority_never_preempts_another_tenant(api: Api) -> None:
    """Attack: a member's priority-100 task (every tenant's default ceiling) preempted
    another tenant's running service."""
    admin = api.login()
    _, victim, a = running_victim(api, admin)
    b = api.member(admin, "tn-b", "bob")
    hog = api.client.post("/api/v1/task-groups", json=job("b-hog", priority=100), headers=b)
    assert hog.status_code == 201, hog.text
    for _ in range(3):
        assert api.app.scheduler.run_round().preempted == 0
    assert api.client.get(f"/api/v1/tasks/{victim}", headers=a).json()["status"] == "running"
    hog_task = api.client.get(f"/api/v1/tasks/{hog.json()['tasks'][0]['id']}", headers=b).json()
    assert hog_task["status"] == "pending"
    assert "another tenant" in hog_task["status_message"], hog_task["status_message"]


@pytest.mark.feature("B4")
def test_a_members_priority_ranks_within_its_own_tenant(api: Api) -> None:
    admin = api.login()
    _, victim, a = running_victim(api, admin)
    mine = api.client.post("/api/v1/task-groups", json=job("a-urgent", priority=50), headers=a)
    assert mine.status_code == 201
    assert api.app.scheduler.run_round().preempted == 1
    v = api.client.get(f"/api/v1/tasks/{victim}", headers=a).json()
    assert v["status"] == "stopping" and v["preempted_by"] == mine.json()["tasks"][0]["id"]


@pytest.mark.feature("B4")
def test_an_operators_platform_priority_preempts_across_tenants(api: Api) -> None:
    admin = api.login()
    b = api.member(admin, "tn-b", "bob")
    _, victim, a = running_victim(api, admin)
    body = job("platform-urgent", priority=900, priority_class="platform")
    member_body = {**body, "priority": 50}  # within the ceiling: the class is what's refused
    assert "operators" in refused(api, b, member_body, "priority_class")
    g = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert g.status_code == 201 and g.json()["priority_class"] == "platform"
    assert api.app.scheduler.run_round().preempted == 1
    assert api.client.get(f"/api/v1/tasks/{victim}", headers=a).json()["status"] == "stopping"
