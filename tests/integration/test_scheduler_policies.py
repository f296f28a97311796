"""The scheduler's policies end to end on a real database: preemption through the
agent protocol (B4), gangs (G1), strict pipeline types (B7), the cross-tenant red line
and sharing groups (B5), QoS (H5), and two schedulers on one PostgreSQL (B4 CAS)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy import select, update

from heteroflow.controllers.scheduler import Scheduler
from heteroflow.db.engine import Database
from heteroflow.db.tables import Event, SharingGroup, Task, Tenant

from .conftest import Api

H100 = {"index": 0, "vendor": "nvidia", "model": "H100", "memory_total_mb": 81920}


def h100s(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{**H100, "index": i, **extra} for i in range(n)]


def job(name: str, *, priority: int = 0, gpus: int = 1, **over: Any) -> dict[str, Any]:
    task = {"image": "busybox:1.36", "command": ["sleep", "3600"], "gpu_required": gpus}
    task.update(over.pop("task", {}))
    return {"name": name, "task_type": "training", "priority": priority, "task": task, **over}


def create(api: Api, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


def task(api: Api, headers: dict[str, str], task_id: str) -> dict[str, Any]:
    return dict(api.client.get(f"/api/v1/tasks/{task_id}", headers=headers).json())


def run(api: Api, node_id: str, task_id: str) -> None:
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text


@pytest.mark.feature("B4")
def test_preemption_stops_lower_priority_work_and_requeues_it(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat(gpus=h100s(1))
    low = create(api, admin, job("low", priority=10))
    low_id = low["tasks"][0]["id"]
    api.app.scheduler.run_round()
    run(api, node, low_id)
    urgent = create(api, admin, job("urgent", priority=500))
    urgent_id = urgent["tasks"][0]["id"]
    r = api.app.scheduler.run_round()
    assert (r.placed, r.preempted) == (0, 1)
    v = task(api, admin, low_id)
    assert v["status"] == "stopping" and v["preempted_by"] == urgent_id
    assert v["status_message"].startswith(f"preempted by {urgent['id']}")
    u = task(api, admin, urgent_id)
    assert u["status"] == "pending" and "preempting 1 lower-priority task(s)" in u["status_message"]
    # the next round waits for the cards instead of preempting again
    assert api.app.scheduler.run_round().preempted == 0
    assert "waiting for 1 preempted task(s)" in task(api, admin, urgent_id)["status_message"]
    # the agent stops it (the task is no longer desired) and reports: back to the queue
    r2 = api.agent_post(node, f"/api/v1/agent/tasks/{low_id}/report", {"status": "stopped"})
    assert r2.status_code == 200 and r2.json()["status"] == "pending"
    v = task(api, admin, low_id)
    assert (v["status"], v["node_id"], v["gpu_ids"], v["preempted_by"]) == ("pending", None, [], "")
    assert api.app.scheduler.run_round().placed == 1
    assert task(api, admin, urgent_id)["status"] == "scheduled"
    assert task(api, admin, low_id)["status_message"].startswith("InsufficientResources")
    with api.app.db.session() as s:
        kinds = {(e.task_id, e.kind) for e in s.scalars(select(Event))}
    assert (urgent_id, "preemption") in kinds


@pytest.mark.feature("B4")
def test_a_scheduled_victim_goes_straight_back_to_the_queue(api: Api) -> None:
    admin = api.login()
    api.heartbeat(gpus=h100s(1))
    low_id = create(api, admin, job("low", priority=1))["tasks"][0]["id"]
    api.app.scheduler.run_round()
    urgent_id = create(api, admin, job("urgent", priority=2))["tasks"][0]["id"]
    assert api.app.scheduler.run_round().preempted == 1
    assert task(api, admin, low_id)["status"] == "pending"
    assert api.app.scheduler.run_round().placed == 1
    assert task(api, admin, urgent_id)["status"] == "scheduled"


@pytest.mark.feature("G1")
def test_pipeline_stages_are_placed_all_or_nothing(api: Api) -> None:
    admin = api.login()
    api.heartbeat("a", gpus=h100s(2))
    api.heartbeat("b", gpus=h100s(2))
    g = create(api, admin, job("pp", gpus=2, parallelism="pipeline", world_size=3))
    assert len(g["tasks"]) == 3
    assert api.app.scheduler.run_round().placed == 0
    reasons = {task(api, admin, t["id"])["status_message"] for t in g["tasks"]}
    assert len(reasons) == 1 and reasons.pop().startswith("gang of 3: member")
    api.heartbeat("c", gpus=h100s(2))
    assert api.app.scheduler.run_round().placed == 3
    nodes = {task(api, admin, t["id"])["node_id"] for t in g["tasks"]}
    assert len(nodes) == 3


@pytest.mark.feature("B7")
def test_pipeline_gpu_type_is_strict_with_distinct_messages(api: Api) -> None:
    admin = api.login()
    api.heartbeat("h", gpus=h100s(2))
    body = job("pp", parallelism="pipeline", world_size=2, task={"gpu_type": "A100"})
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400 and "no node you may use reports gpu_type 'A100'" in r.text
    assert "task.gpu_type" in r.text
    a100 = [{**H100, "model": "A100", "index": i} for i in range(2)]
    api.heartbeat("a", gpus=a100)
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    api.heartbeat("h", gpus=h100s(2))  # only the H100 node stays online
    g = create(api, admin, body)
    api.app.scheduler.run_round()
    msg = task(api, admin, g["tasks"][0]["id"])["status_message"]
    assert msg.startswith("Waiting: all 1 node(s) with gpu_type 'A100' are offline")
    # an inference pipeline is vLLM's alone (issue 32): llama.cpp's is a 400 naming vLLM
    llama = {"image": "ghcr.io/ggml-org/llama.cpp:server", "command": []}
    r = api.client.post("/api/v1/task-groups", json=job("inf-pp", parallelism="pipeline",
                        world_size=2, task_type="inference", task=llama), headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "parallelism", r.text
    assert "with vllm only" in r.text


@pytest.mark.feature("B5")
@pytest.mark.feature("N3")
def test_cross_tenant_red_line_and_sharing_group(api: Api) -> None:
    admin = api.login()
    api.heartbeat(gpus=h100s(1))
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    svc = {"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 1, "model_path": "/m/a"}
    create(api, one, {"name": "a", "gpu_memory_utilization": 40, "task": svc})
    api.clock.advance(1)  # FIFO within a priority: "a" is older
    b = create(api, two, {"name": "b", "gpu_memory_utilization": 40, "task": svc})
    assert api.app.scheduler.run_round().placed == 1
    msg = task(api, two, b["tasks"][0]["id"])["status_message"]
    assert "another tenant's work" in msg
    # the dry run previews with the same rules, for the caller's tenant
    r = api.client.post("/api/v1/task-groups?dry_run=true", headers=two,
                        json={"name": "c", "gpu_memory_utilization": 40, "task": svc})
    assert r.status_code == 200 and "another tenant's work" in r.json()["tasks"][0][
        "pending_reason"]
    with api.app.db.session() as s:
        s.add(SharingGroup(id="sg1", name="partners", created_at=api.clock.now()))
        s.flush()
        s.execute(update(Tenant).where(Tenant.name.in_(["one", "two"])).values(
            sharing_group_id="sg1"))
    assert api.app.scheduler.run_round().placed == 1
    assert task(api, two, b["tasks"][0]["id"])["gpu_ids"] == [0]


@pytest.mark.feature("H5")
def test_qos_is_recorded_at_placement(api: Api) -> None:
    admin = api.login()
    api.heartbeat("mig", gpus=h100s(1, mig_capable=True))
    g = create(api, admin, job("j"))
    api.app.scheduler.run_round()
    t = task(api, admin, g["tasks"][0]["id"])
    assert t["qos"] == "gold" and "QoS gold" in t["status_message"]


@pytest.mark.feature("B4")
def test_two_schedulers_on_one_postgresql_never_double_book(api: Api, db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks and SKIP LOCKED are PostgreSQL's; SQLite has one writer")
    admin = api.login()
    for i in range(6):
        api.heartbeat(f"n{i}", gpus=h100s(8))
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    svc = {"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 1, "model_path": "/m/a"}
    for i in range(24):
        who = one if i % 2 else two
        create(api, who, {"name": f"s{i}", "gpu_memory_utilization": 30, "task": svc})
        create(api, who, job(f"j{i}", gpus=1 + i % 2, priority=i % 3))
    other = Database.from_url(db_url)
    policy = api.app.scheduler.policy
    kw = dict(interval_s=1, offline_after_s=60, port_pool=range(21000, 21010), policy=policy,
              workers=2, worker_chunk=5)
    scheds = [Scheduler(api.app.db, api.clock, **kw), Scheduler(other, api.clock, **kw)]  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def go(s: Scheduler) -> None:
        try:
            for _ in range(3):
                s.reconcile_once(api.clock.now())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(s,)) for s in scheds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    other.dispose()
    assert not errors
    with api.app.db.session() as s:
        held = s.execute(
            select(Task.node_id, Task.gpu_ids, Task.tenant_id, Task.task_type,
                   Task.gpu_memory_utilization, Task.gpu_required)
            .where(Task.status == "scheduled")
        ).all()
    assert len(held) >= 40
    cards: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for row in held:
        for g in row.gpu_ids:
            cards[(row.node_id, g)].append(row)
    for rows in cards.values():
        whole = [r for r in rows if r.task_type != "inference" or r.gpu_required > 1]
        assert not whole or len(rows) == 1, f"whole card shared: {rows}"
        assert sum(r.gpu_memory_utilization for r in rows) <= 100
        assert len({r.tenant_id for r in rows}) == 1


@pytest.mark.feature("B4")
def test_a_stale_view_loses_the_booking_cas_and_the_task_stays_queued(
    api: Api, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another scheduler books the node between our read and our commit: our decision
    is dropped (counted as a conflict), the task stays pending for the next round."""
    if not db_url.startswith("postgresql"):
        pytest.skip("needs a second writer during the round (PostgreSQL)")
    from heteroflow.core.placement import FleetIndex as real
    from heteroflow.db.tables import Node

    admin = api.login()
    node_id = api.heartbeat(gpus=h100s(1))
    t_id = create(api, admin, job("j"))["tasks"][0]["id"]

    def index_then_someone_else_books(*a: Any, **kw: Any) -> Any:
        idx = real(*a, **kw)
        with api.app.db.session() as other:  # a second connection, committed now
            other.execute(
                update(Node).where(Node.id == node_id)
                .values(booking_version=Node.booking_version + 1)
            )
        return idx

    target = "heteroflow.services.placement.placer.FleetIndex"  # the round's placer builds it
    monkeypatch.setattr(target, index_then_someone_else_books)
    r = api.app.scheduler.run_round()
    assert (r.placed, r.conflicts) == (0, 1)
    assert task(api, admin, t_id)["status"] == "pending"
    monkeypatch.setattr(target, real)
    assert api.app.scheduler.run_round().placed == 1


def _dedicate(api: Api, node_name: str, tenant_ids: list[str]) -> None:
    from heteroflow.db.tables import Node

    with api.app.db.session() as s:
        s.execute(update(Node).where(Node.name == node_name).values(
            labels={"heteroflow.tenants": ",".join(tenant_ids)}))


@pytest.mark.feature("B7")
@pytest.mark.feature("N1")
def test_nodes_dedicated_to_a_tenant_are_used_and_seen_by_it_only(api: Api) -> None:
    admin = api.login()
    api.heartbeat("shared", gpus=h100s(1))
    api.heartbeat("private", gpus=[{**H100, "model": "A100"}])
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    tenants = {t["name"]: t["id"] for t in api.client.get("/api/v1/tenants", headers=admin).json()}
    _dedicate(api, "private", [tenants["one"]])
    # members see the nodes they may use; operators the whole fleet
    def names(h: dict[str, str]) -> list[str]:
        return sorted(n["name"] for n in api.client.get("/api/v1/nodes", headers=h).json())

    assert (names(one), names(two), names(admin)) == (
        ["private", "shared"], ["shared"], ["private", "shared"])
    # pipelines are an operator's (host network); the operator's own tenant may not use
    # the node dedicated to "one" either, so B7's strict type finds no A100 it may use
    body = job("pp", parallelism="pipeline", world_size=2, task={"gpu_type": "A100"})
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400 and "no node you may use reports gpu_type 'A100'" in r.text
    r = api.client.post("/api/v1/task-groups", json=body, headers=one)
    assert r.status_code == 400 and "host network" in r.text
    g = create(api, two, job("j2", task={"gpu_type": "A100"}))
    api.app.scheduler.run_round()
    msg = task(api, two, g["tasks"][0]["id"])["status_message"]
    assert "1 node(s): dedicated to other tenants" in msg
