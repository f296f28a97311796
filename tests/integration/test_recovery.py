"""The recovery loop (E1-E4) on a real database with a fake clock: failed services come
back as new tasks of the same rank, at most five times in a row, and work moves off lost
nodes and cards. The agent protocol is driven by hand (claim, report), as in
test_fault_events.py."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Task
from heteroflow.services.lifecycle.recovery import RecoveryResult
from heteroflow.services.lifecycle.transitions import transition

from .conftest import NODE_TOKEN, Api, service_body
from .test_fault_events import create, events, faults, report, start

A10 = {
    "index": 0,
    "vendor": "nvidia",
    "model": "A10",
    "memory_total_mb": 24576,
    "compute_capability": "8.6",
}


@pytest.fixture(autouse=True)
def _leads_from_the_start(api: Api) -> None:
    """This instance took the lease when the test began, as a server's elector does at
    start: a new leader counts a node's silence from its takeover at the earliest."""
    api.app.leadership.reconcile_once(api.clock.now())


def recovery_round(api: Api) -> RecoveryResult:
    """One round as the leader (the elector renews first: the loop is leader-only)."""
    api.app.leadership.reconcile_once(api.clock.now())
    return api.app.recovery.run_round()


def task(api: Api, headers: dict[str, str], task_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/tasks/{task_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def group(api: Api, headers: dict[str, str], group_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def current(api: Api, headers: dict[str, str], group_id: str) -> dict[str, Any]:
    tasks = group(api, headers, group_id)["tasks"]
    assert len(tasks) == 1, tasks
    return dict(tasks[0])


def fail(api: Api, node_id: str, task_id: str, message: str = "engine exited with code 3",
         fault: str | None = "engine_exited") -> None:
    body: dict[str, Any] = {"status": "failed", "message": message}
    if fault:
        body["fault"] = fault
    r = report(api, node_id, task_id, body)
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text


def run_and_fail(api: Api, admin: dict[str, str], node_id: str, group_id: str,
                 ran_s: float) -> str:
    """Place the group's current task, start it, let it run ``ran_s``, fail it."""
    assert api.heartbeat() == node_id  # still online however far the clock moved
    api.app.scheduler.run_round()
    t = current(api, admin, group_id)
    assert t["status"] == "scheduled", t
    start(api, node_id, t["id"])
    api.clock.advance(ran_s)
    fail(api, node_id, t["id"])
    return str(t["id"])


@pytest.mark.feature("E1", "E2")
def test_a_failed_service_comes_back_as_a_new_task_of_its_rank(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, first = create(api, admin, service_body())
    api.app.scheduler.run_round()
    old = task(api, admin, first)
    assert old["ports"][0]["from_pool"] and old["ports"][0]["host_port"]
    start(api, node_id, first)
    fail(api, node_id, first, "engine exited with code 3; last output:\nCUDA error")
    assert group(api, admin, group_id)["status"] == "failed"

    result = recovery_round(api)
    assert len(result.rebuilt) == 1 and result.gave_up == []
    new_id = result.rebuilt[0]
    old = task(api, admin, first)
    assert (old["status"], old["replaced_by"]) == ("failed", new_id)  # kept as history
    new = task(api, admin, new_id)
    assert (new["rank"], new["generation"], new["rebuild_count"]) == (0, 1, 1)
    assert (new["status"], new["node_id"], new["gpu_ids"]) == ("pending", None, [])
    assert new["ports"] == [{"container_port": 8000, "host_port": 0}]  # back to the pool
    assert (new["image"], new["engine"], new["model_path"]) == (
        old["image"], old["engine"], old["model_path"],
    )
    g = group(api, admin, group_id)
    assert [t["id"] for t in g["tasks"]] == [new_id]  # only the current task
    assert g["status"] == "pending" and "engine_exited" in g["status_message"]

    # E2: one group-level event per real rebuild, with its cause, after the failure
    rebuilt = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuilt"]
    assert len(rebuilt) == 1
    text = rebuilt[0]["message"]
    assert rebuilt[0]["task_id"] == new_id and first in text and new_id in text
    assert "cause: fault.engine_exited: engine exited with code 3" in text
    assert "rebuild 1 of at most 5" in text
    kinds = [e["kind"] for e in events(api, admin, group_id)]
    assert kinds.index("fault.engine_exited") < kinds.index("fault.rebuilt")

    assert recovery_round(api).rebuilt == []  # level-triggered: once
    assert len([e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuilt"]) == 1
    # the scheduler places it again, on the node that holds the model (the only one)
    assert api.app.scheduler.run_round().placed == 1
    again = task(api, admin, new_id)
    assert again["status"] == "scheduled" and again["node_id"] == node_id
    start(api, node_id, new_id)
    assert group(api, admin, group_id)["status"] == "running"


@pytest.mark.feature("E1")
def test_five_rebuilds_in_a_row_then_it_gives_up_once(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, _ = create(api, admin, service_body())
    for n in range(5):
        run_and_fail(api, admin, node_id, group_id, ran_s=5)
        rebuilt = recovery_round(api).rebuilt
        assert len(rebuilt) == 1 and task(api, admin, rebuilt[0])["rebuild_count"] == n + 1
    last = run_and_fail(api, admin, node_id, group_id, ran_s=5)  # the fifth rebuild fails
    result = recovery_round(api)
    assert (result.rebuilt, result.gave_up) == ([], [last])
    g = group(api, admin, group_id)
    assert g["status"] == "failed" and g["tasks"][0]["id"] == last
    assert g["status_message"].startswith("recovery gave up")
    assert "5 times in a row" in g["status_message"]
    gave_up = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuild_gave_up"]
    assert len(gave_up) == 1 and gave_up[0]["task_id"] == last
    assert "engine exited with code 3" in gave_up[0]["message"]
    api.clock.advance(60)
    assert recovery_round(api).gave_up == []  # said once
    assert len([e for e in faults(api, admin, group_id) if e["kind"].startswith("fault.rebuil")
                ]) == 6  # five rebuilds, one "gave up"


@pytest.mark.feature("E1")
def test_sixty_stable_seconds_start_the_count_again(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, _ = create(api, admin, service_body())
    for _ in range(4):
        run_and_fail(api, admin, node_id, group_id, ran_s=59)  # not quite stable
        recovery_round(api)
    assert current(api, admin, group_id)["rebuild_count"] == 4
    run_and_fail(api, admin, node_id, group_id, ran_s=60)  # stable: the count resets
    rebuilt = recovery_round(api).rebuilt
    assert task(api, admin, rebuilt[0])["rebuild_count"] == 1


@pytest.mark.feature("E1")
def test_no_rebuild_for_a_stopped_or_deleted_group_or_a_completed_task(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    stopped, t1 = create(api, admin, service_body(name="stopped"))
    deleted, t2 = create(api, admin, service_body(name="deleted"))
    _, t3 = create(
        api, admin, service_body(name="job", task_type="training", enable_api=False,
                                 task={"model_path": "", "command": ["python", "train.py"]}),
    )
    api.app.scheduler.run_round()
    for t in (t1, t2, t3):
        start(api, node_id, t)
    fail(api, node_id, t1)
    fail(api, node_id, t2)
    assert api.client.post(f"/api/v1/task-groups/{stopped}/stop", headers=admin).status_code == 200
    assert api.client.delete(f"/api/v1/task-groups/{deleted}", headers=admin).status_code == 204
    r = report(api, node_id, t3, {"status": "completed", "message": "exited with code 0"})
    assert r.status_code == 200
    assert recovery_round(api).rebuilt == []
    with api.app.db.session() as s:
        assert s.scalar(select(Task).where(Task.replaced_by != "")) is None


@pytest.mark.feature("E1")
def test_training_is_rebuilt_off_lost_hardware_but_not_after_its_own_failure(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    body = service_body(name="job", task_type="training", enable_api=False,
                        task={"model_path": "", "command": ["python", "train.py"]})
    _, t = create(api, admin, body)
    api.app.scheduler.run_round()
    start(api, node_id, t)
    fail(api, node_id, t, "exited with code 1")
    assert recovery_round(api).rebuilt == []  # its own result
    _, t2 = create(api, admin, {**body, "name": "job2"})
    api.app.scheduler.run_round()
    start(api, node_id, t2)
    fail(api, node_id, t2, "container removed behind the agent's back", "container_lost")
    assert len(recovery_round(api).rebuilt) == 1


@pytest.mark.feature("E4", "E2")
def test_a_lost_nodes_tasks_move_to_another_node_after_the_delay(api: Api) -> None:
    admin = api.login()
    a = api.heartbeat("node-a")
    group_id, first = create(api, admin, service_body())
    sleepy, asleep = create(api, admin, service_body(name="sleepy"))
    queued, waiting = create(api, admin, service_body(name="queued"))
    assert api.app.scheduler.run_round().placed == 3
    start(api, a, first)
    start(api, a, asleep)
    with api.app.db.session() as s:  # asleep on the node (F1 holds its placement)
        assert transition(s, api.app.clock, asleep, TaskStatus.RUNNING, TaskStatus.SLEEPING)
    b = api.heartbeat("node-b")
    settings = api.app.settings
    lost_after = settings.node_offline_after_s + settings.node_migrate_after_s

    api.clock.advance(lost_after - 1)
    api.heartbeat("node-b")
    assert recovery_round(api) == RecoveryResult()  # lost, but not for long enough
    api.clock.advance(2)
    api.heartbeat("node-b")
    result = recovery_round(api)
    assert sorted(result.evacuated) == sorted([first, asleep])
    assert result.requeued == [waiting]  # never started there: simply placed again
    assert len(result.rebuilt) == 2
    assert task(api, admin, first)["status"] == "failed"
    assert "node node-a lost" in task(api, admin, first)["status_message"]
    w = task(api, admin, waiting)
    assert (w["status"], w["node_id"], w["ports"][0]["host_port"]) == ("pending", None, 0)
    assert api.app.scheduler.run_round().placed == 3
    for gid in (group_id, sleepy, queued):
        assert current(api, admin, gid)["node_id"] == b  # elsewhere
    # the timeline: the loss, the failure there, the rebuild
    kinds = [e["kind"] for e in faults(api, admin, group_id)]
    assert kinds == ["fault.evacuated", "fault.rebuilt"]
    moved = faults(api, admin, group_id)
    assert "node node-a lost" in moved[1]["message"] and "fault.evacuated" in moved[1]["message"]

    # node-a's agent comes back: its tasks are no longer listed (it stops / reaps them)
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200 and r.json()["tasks"] == []


@pytest.mark.feature("E4")
def test_a_new_leader_gives_every_node_a_whole_delay_before_moving_its_work(api: Api) -> None:
    """The heartbeats of a node may have gone to the leader that died: a new leader
    cannot tell that silence from the node's own, so it counts it from its takeover."""
    admin = api.login()
    a = api.heartbeat("node-a")
    _, first = create(api, admin, service_body())
    assert api.app.scheduler.run_round().placed == 1
    start(api, a, first)
    settings = api.app.settings
    lost_after = settings.node_offline_after_s + settings.node_migrate_after_s
    api.clock.advance(lost_after + 1)  # node-a silent for long enough ...
    api.heartbeat("node-b")
    api.app.leadership.release(api.clock.now())  # ... as the lease changes hands
    result = recovery_round(api)
    assert (result.waiting, result.evacuated) == (["node-a"], [])
    assert task(api, admin, first)["status"] == "running"
    api.clock.advance(lost_after + 1)
    api.heartbeat("node-b")
    assert recovery_round(api).evacuated == [first]


@pytest.mark.feature("E4")
def test_nodes_lost_all_at_once_keep_their_work_until_most_are_heard_again(api: Api) -> None:
    """A control-plane fault (the server the agents reach stalled, a split) looks like
    every node lost at once: failing every healthy replica would make it an outage."""
    admin = api.login()
    settings = api.app.settings
    offline, lost_after = (
        settings.node_offline_after_s,
        settings.node_offline_after_s + settings.node_migrate_after_s,
    )
    a = api.heartbeat("node-a")
    one, on_a = create(api, admin, service_body(name="one"))
    assert api.app.scheduler.run_round().placed == 1
    start(api, a, on_a)
    api.clock.advance(offline + 1)  # node-a is offline: the next one lands on node-b
    b = api.heartbeat("node-b")
    two, on_b = create(api, admin, service_body(name="two"))
    assert api.app.scheduler.run_round().placed == 1
    start(api, b, on_b)
    api.heartbeat("node-a")
    api.heartbeat("node-c")  # idle

    api.clock.advance(lost_after + 1)  # nobody is heard from: every node lost at once
    result = recovery_round(api)
    assert (result.held, result.evacuated) == (["node-a", "node-b"], [])
    api.heartbeat("node-c")  # 2 of 3 still lost: still more than the threshold
    assert recovery_round(api).held == ["node-a", "node-b"]
    for t in (on_a, on_b):
        assert task(api, admin, t)["status"] == "running"
    # each group's timeline says why its lost node's work did not move, once
    for gid, node in ((one, "node-a"), (two, "node-b")):
        held = [e for e in faults(api, admin, gid) if e["kind"] == "fault.evacuation_held"]
        assert len(held) == 1 and f"node {node} lost" in held[0]["message"], held

    api.heartbeat("node-b")  # now 1 of 3: the disruption is over ...
    result = recovery_round(api)
    # ... but nodes come back one by one: node-a's silence counts from now, or the last
    # node heard after a stall would lose its work for being a second late
    assert (result.held, result.waiting, result.evacuated) == ([], ["node-a"], [])
    api.clock.advance(lost_after - 1)
    api.heartbeat("node-b")
    api.heartbeat("node-c")
    assert recovery_round(api).evacuated == []
    api.clock.advance(2)
    api.heartbeat("node-b")
    api.heartbeat("node-c")
    result = recovery_round(api)  # silent a whole delay since the disruption: it moves
    assert (result.held, result.waiting, result.evacuated) == ([], [], [on_a])
    assert task(api, admin, on_b)["status"] == "running"


@pytest.mark.feature("E4")
def test_a_lost_cards_task_is_rebuilt_on_another_card(api: Api) -> None:
    admin = api.login()
    cards = [A10, {**A10, "index": 1, "uuid": "GPU-b"}]
    node_id = api.heartbeat(gpus=cards)
    body = service_body(name="gpu", task={"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 1})
    group_id, first = create(api, admin, body)
    api.app.scheduler.run_round()
    start(api, node_id, first)
    card = task(api, admin, first)["gpu_ids"][0]
    left = [c for c in cards if c["index"] != card]
    api.heartbeat(gpus=left)  # the card vanished (fault.gpu_lost)
    assert recovery_round(api) == RecoveryResult()  # a driver glitch would be back by now
    api.clock.advance(api.app.settings.node_migrate_after_s + 1)
    api.heartbeat(gpus=left)
    result = recovery_round(api)
    assert result.evacuated == [first] and len(result.rebuilt) == 1
    assert f"GPU {card} gone" in task(api, admin, first)["status_message"]
    assert api.app.scheduler.run_round().placed == 1
    new = task(api, admin, result.rebuilt[0])
    assert new["node_id"] == node_id and new["gpu_ids"] == [left[0]["index"]]
    kinds = [e["kind"] for e in faults(api, admin, group_id)]
    assert kinds == ["fault.gpu_lost", "fault.evacuated", "fault.rebuilt"]


def engine_heartbeat(api: Api, name: str, engines: dict[str, str]) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name, "address": "127.0.0.1", "runtime": "docker", "engines": engines,
            "allowed_volume_prefixes": ["/data/models"],
            "inventory": {"gpus": [A10], "cpu_count": 8, "memory_total_mb": 65536},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


@pytest.mark.feature("E3")
def test_an_engine_that_keeps_failing_to_start_falls_back_along_the_templates(api: Api) -> None:
    admin = api.login()
    engines = {"vllm": "vllm/vllm-openai:v0.11.2", "llamacpp": "ghcr.io/ggml-org/llama.cpp:server"}
    node_id = engine_heartbeat(api, "node-a", engines)
    body = {"name": "oneclick", "task": {"model_path": "qwen", "gpu_required": 1,
                                         "engine_args": ["--max-model-len", "4096"]}}
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    g = r.json()
    assert [t["engine"] for t in g["inference_templates"]] == ["vllm", "llamacpp"]
    group_id, first = g["id"], g["tasks"][0]["id"]

    def fail_to_start(task_id: str) -> None:
        api.app.scheduler.run_round()
        assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code \
            == 200
        fail(api, node_id, task_id, "engine exited with code 1: no CUDA", "engine_exited")

    fail_to_start(first)
    (second,) = recovery_round(api).rebuilt
    assert task(api, admin, second)["engine"] == "vllm"  # once may be bad luck
    fail_to_start(second)
    (third,) = recovery_round(api).rebuilt
    t = task(api, admin, third)
    assert (t["engine"], t["image"]) == ("llamacpp", "ghcr.io/ggml-org/llama.cpp:server")
    assert t["engine_reason"].startswith("fallback after vllm failed to start 2 times")
    assert t["rebuild_count"] == 2
    with api.app.db.session() as s:
        row = s.get(Task, third)
        assert row is not None and row.engine_args == []  # they were vLLM's
    said = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuilt"][-1]
    assert "falling back to llamacpp" in said["message"]
    assert "engine arguments, written for vllm, are dropped" in said["message"]
    api.app.scheduler.run_round()
    start(api, node_id, third)
    assert group(api, admin, group_id)["status"] == "running"
