"""Sleep and wake through the real API (F1, F2, F3, F5, A8): every wake branch, the
wake retrier (fake clock), tenancy, audit, the group routes and the agent's light poll.

The agent protocol is driven by hand (claim, report) as in test_fault_events.py; the
agent's engine side is in test_sleep_wake_agent.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.services.lifecycle.wake_retry import WakeRound

from .conftest import Api, service_body

A10 = {"index": 0, "vendor": "nvidia", "model": "A10", "memory_total_mb": 24576}


def create(api: Api, admin: dict[str, str], body: dict[str, Any]) -> tuple[str, str]:
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    g = r.json()
    return str(g["id"]), str(g["tasks"][0]["id"])


def report(api: Api, node_id: str, task_id: str, status: str, **extra: Any) -> Any:
    body = {"status": status, **extra}
    return api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", body)


def start(api: Api, node_id: str, task_id: str) -> None:
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    assert report(api, node_id, task_id, "running").status_code == 200


def running_service(
    api: Api, admin: dict[str, str], node: str = "node-a", **over: Any
) -> tuple[str, str, str]:
    """A service whose one task runs on ``node`` (placed by the real scheduler)."""
    node_id = api.heartbeat(node)
    group_id, task_id = create(api, admin, service_body(**over))
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    return node_id, group_id, task_id


def task(api: Api, headers: dict[str, str], task_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/tasks/{task_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def group(api: Api, headers: dict[str, str], group_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def events(api: Api, headers: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}/events", headers=headers)
    return list(r.json())


def retrier_round(api: Api) -> WakeRound:
    api.app.leadership.reconcile_once(api.clock.now())  # the retrier is leader-only
    return api.app.wakes.run_round()


def post(api: Api, headers: dict[str, str], path: str) -> Any:
    return api.client.post(path, headers=headers)


@pytest.mark.feature("F1", "A7", "A8")
def test_sleep_keeps_the_placement_and_wake_brings_it_back(api: Api) -> None:
    admin = api.login()
    node_id, group_id, task_id = running_service(api, admin)
    before = task(api, admin, task_id)

    r = post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    assert r.status_code == 202, r.text
    slept = r.json()
    assert slept["status"] == "sleeping"
    # F1: it keeps its node, cards and ports (the agent stops the engine)
    assert (slept["node_id"], slept["gpu_ids"], slept["ports"]) == (
        before["node_id"], before["gpu_ids"], before["ports"]
    )
    assert "put to sleep by admin" in slept["status_message"]
    assert group(api, admin, group_id)["status"] == "sleeping"
    # the agent is told (its heartbeat lists it, and the light poll names it)
    beat = {"name": "node-a", "address": "127.0.0.1", "inventory": {}}
    listed = api.agent_post(node_id, "/api/v1/agent/heartbeat", beat).json()["tasks"]
    assert [(t["id"], t["status"]) for t in listed] == [(task_id, "sleeping")]
    life = api.client.get(
        "/api/v1/agent/task-life",
        headers={"Authorization": "Bearer node-token-for-tests", "X-Heteroflow-Node": node_id},
    )
    assert life.json() == {"sleeping": [task_id], "waking": []}
    # sleeping again changes nothing
    again = post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    assert again.status_code == 202 and again.json()["status"] == "sleeping"

    r = post(api, admin, f"/api/v1/tasks/{task_id}/wake")
    assert r.status_code == 202, r.text
    woke = r.json()
    assert (woke["task_id"], woke["status"], woke["branch"]) == (task_id, "waking", "waking")
    assert woke["wake_requested"] is False
    assert group(api, admin, group_id)["status"] == "waking"
    # a second wake while waking says so
    assert post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()["branch"] == "waking"
    # the agent reports it healthy again
    assert report(api, node_id, task_id, "running").status_code == 200
    assert task(api, admin, task_id)["status"] == "running"
    assert group(api, admin, group_id)["status"] == "running"
    assert post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()["branch"] == "already_running"
    moves = [
        (e["from_status"], e["to_status"])
        for e in events(api, admin, group_id)
        if e["kind"] == "task_status"
    ]
    assert moves[-3:] == [("running", "sleeping"), ("sleeping", "waking"), ("waking", "running")]


@pytest.mark.feature("F1", "A8")
def test_only_a_running_inference_task_sleeps(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    _, task_id = create(api, admin, service_body())
    r = post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    assert r.status_code == 409 and "is pending" in r.json()["error"]["message"]
    api.app.scheduler.run_round()
    api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    r = post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    assert r.status_code == 409 and "is starting" in r.json()["error"]["message"]
    # a stopped task is started again, not woken
    post(api, admin, f"/api/v1/tasks/{task_id}/stop")
    report(api, node_id, task_id, "stopped")
    r = post(api, admin, f"/api/v1/tasks/{task_id}/wake")
    assert r.status_code == 409 and "stopped" in r.json()["error"]["message"]
    assert post(api, admin, "/api/v1/tasks/task-000000000000/sleep").status_code == 404


@pytest.mark.feature("A8")
def test_other_tenants_get_404_and_every_call_is_audited(api: Api) -> None:
    admin = api.login()
    _, group_id, task_id = running_service(api, admin)
    outsider = api.member(admin, "other", "mallory")
    for path in (
        f"/api/v1/tasks/{task_id}/sleep",
        f"/api/v1/tasks/{task_id}/wake",
        f"/api/v1/task-groups/{group_id}/sleep",
        f"/api/v1/task-groups/{group_id}/wake",
    ):
        assert post(api, outsider, path).status_code == 404, path
    assert task(api, admin, task_id)["status"] == "running"
    assert post(api, admin, f"/api/v1/tasks/{task_id}/sleep").status_code == 202
    rows = api.client.get("/api/v1/audit", headers=admin).json()
    items = rows["records"]
    seen = {(r["path"], r["status"]) for r in items}
    assert (f"/api/v1/tasks/{task_id}/sleep", 202) in seen
    assert (f"/api/v1/tasks/{task_id}/sleep", 404) in seen


@pytest.mark.feature("F3")
def test_node_offline_wake_is_queued_then_done_when_the_node_returns(api: Api) -> None:
    admin = api.login()
    node_id, group_id, task_id = running_service(api, admin)
    post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    api.clock.advance(api.app.settings.node_offline_after_s + 1)  # no heartbeat since

    r = post(api, admin, f"/api/v1/tasks/{task_id}/wake")
    assert r.status_code == 202
    w = r.json()
    assert (w["branch"], w["status"], w["wake_requested"]) == ("node_offline", "sleeping", True)
    assert "node node-a is offline" in w["message"]
    t = task(api, admin, task_id)
    assert t["wake_requested"] is True and "node node-a is offline" in t["status_message"]
    # asking again (the gateway does, per request) records it once
    assert post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()["branch"] == "node_offline"
    deferred = [e for e in events(api, admin, group_id) if e["kind"] == "task.wake_deferred"]
    assert len(deferred) == 1
    assert retrier_round(api).waiting == [task_id]

    api.heartbeat("node-a")  # the node is back
    assert retrier_round(api).woken == [task_id]
    t = task(api, admin, task_id)
    assert (t["status"], t["wake_requested"]) == ("waking", False)
    assert report(api, node_id, task_id, "running").status_code == 200


@pytest.mark.feature("F3")
def test_a_node_that_stays_away_fails_the_waiting_task_for_a_rebuild(api: Api) -> None:
    admin = api.login()
    _, _, task_id = running_service(api, admin)
    post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    assert post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()["branch"] == "node_offline"
    api.clock.advance(api.app.settings.wake_node_lost_after_s)
    assert retrier_round(api).failed == [task_id]
    t = task(api, admin, task_id)
    assert t["status"] == "failed"
    assert "node node-a has had no heartbeat" in t["status_message"]
    assert "rebuilt elsewhere" in t["status_message"]
    w = post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()
    assert (w["branch"], w["status"]) == ("failed", "failed")


@pytest.mark.feature("F3")
def test_a_waking_task_whose_node_is_lost_fails(api: Api) -> None:
    admin = api.login()
    _, _, task_id = running_service(api, admin)
    post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    assert post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()["branch"] == "waking"
    api.clock.advance(5)
    assert retrier_round(api).failed == []  # the agent has time to report
    api.clock.advance(api.app.settings.wake_node_lost_after_s)
    assert retrier_round(api).failed == [task_id]
    assert "lost while the task was waking" in task(api, admin, task_id)["status_message"]


@pytest.mark.feature("F3", "F5")
def test_cards_borrowed_by_training_make_the_wake_wait_until_it_ends(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat("gpu-node", gpus=[A10])
    group_id, task_id = create(
        api, admin, service_body(task={"gpu_required": 1, "model_path": "tiny.gguf"})
    )
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    assert task(api, admin, task_id)["gpu_ids"] == [0]
    post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    # F5: training may borrow the sleeping service's card
    train = {
        "name": "train",
        "task_type": "training",
        "task": {
            "image": "trainer:latest",
            "command": ["python", "train.py"],
            "gpu_required": 1,
        },
    }
    _, train_id = create(api, admin, train)
    api.app.scheduler.run_round()
    borrowed = task(api, admin, train_id)
    assert borrowed["status"] == "scheduled" and borrowed["gpu_ids"] == [0], borrowed
    assert "borrowing the cards of a sleeping inference service" in borrowed["status_message"]
    start(api, node_id, train_id)

    w = post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()
    assert (w["branch"], w["status"], w["wake_requested"]) == ("card_borrowed", "sleeping", True)
    assert train_id in w["message"] and "card(s) [0]" in w["message"]
    assert retrier_round(api).waiting == [task_id]
    # the training ends: the queued wake happens
    assert report(api, node_id, train_id, "completed").status_code == 200
    assert retrier_round(api).woken == [task_id]
    assert task(api, admin, task_id)["status"] == "waking"
    kinds = [e["kind"] for e in events(api, admin, group_id)]
    assert kinds.count("task.wake_deferred") == 1


@pytest.mark.feature("F3", "C2")
def test_a_container_gone_at_wake_is_said_so(api: Api) -> None:
    admin = api.login()
    node_id, group_id, task_id = running_service(api, admin)
    post(api, admin, f"/api/v1/tasks/{task_id}/sleep")
    post(api, admin, f"/api/v1/tasks/{task_id}/wake")
    # the agent finds the kept container gone (what the daemon reports, see the agent test)
    r = report(
        api, node_id, task_id, "failed", message="container gone at wake", fault="container_lost"
    )
    assert r.status_code == 200, r.text
    w = post(api, admin, f"/api/v1/tasks/{task_id}/wake").json()
    assert (w["branch"], w["status"]) == ("container_gone", "failed")
    assert "container was gone at wake" in w["message"]
    faults = [e for e in events(api, admin, group_id) if e["kind"] == "fault.container_lost"]
    assert faults and "container gone at wake" in faults[0]["message"]


@pytest.mark.feature("F1", "A8")
def test_group_sleep_and_wake_cover_every_current_task(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(parallelism="split", world_size=2), headers=admin
    )
    assert r.status_code == 201, r.text
    group_id = r.json()["id"]
    ids = [t["id"] for t in r.json()["tasks"]]
    api.app.scheduler.run_round()
    start(api, node_id, ids[0])
    api.agent_post(node_id, f"/api/v1/agent/tasks/{ids[1]}/claim", {})  # still starting

    r = post(api, admin, f"/api/v1/task-groups/{group_id}/sleep")
    assert r.status_code == 202, r.text
    assert r.json() == {"group_id": group_id, "slept": [ids[0]], "skipped": {ids[1]: "starting"}}
    r = post(api, admin, f"/api/v1/task-groups/{group_id}/wake")
    assert r.status_code == 202, r.text
    branches = {x["task_id"]: x["branch"] for x in r.json()["results"]}
    assert branches == {ids[0]: "waking", ids[1]: "starting"}


def test_training_groups_do_not_sleep(api: Api) -> None:
    admin = api.login()
    api.heartbeat("gpu-node", gpus=[A10])
    train = {
        "name": "train",
        "task_type": "training",
        "task": {"image": "t:1", "command": ["x"], "gpu_required": 1},
    }
    group_id, task_id = create(api, admin, train)
    r = post(api, admin, f"/api/v1/task-groups/{group_id}/sleep")
    assert r.status_code == 409 and "only inference services sleep" in r.json()["error"]["message"]
    r = post(api, admin, f"/api/v1/tasks/{task_id}/wake")
    assert r.status_code == 409


def test_platform_callers_use_the_same_functions(api: Api) -> None:
    """The idle timer and the gateway call the services with who=None (the platform)."""
    from heteroflow.services.lifecycle import sleep

    admin = api.login()
    _, group_id, task_id = running_service(api, admin)
    with api.app.db.session() as s:
        assert sleep.sleep_group(s, api.clock, group_id, "idle for 15 minutes") == [task_id]
    t = task(api, admin, task_id)
    assert t["status"] == "sleeping" and t["status_message"] == "put to sleep: idle for 15 minutes"
    with api.app.db.session() as s:
        [result] = sleep.wake_group(s, api.clock, group_id, "a request arrived")
    assert (result.branch, result.status) == ("waking", "waking")
    with api.app.db.session() as s:
        again = sleep.wake_task(s, api.clock, None, task_id, "a request arrived")
    assert again.branch == "waking"
