"""Scheduler v1 rounds and the agent protocol (heartbeat, claim, report) on a real DB."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, service_body

A10 = {"index": 0, "vendor": "nvidia", "model": "A10", "memory_total_mb": 24576}


def running_service(
    api: Api, admin: dict[str, str], node_id: str
) -> tuple[dict[str, Any], str]:
    """A service whose only task was placed, claimed and reported running."""
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200
    return g, task_id


def gpu_service(name: str = "gsvc", **task: object) -> dict[str, Any]:
    return service_body(
        name=name,
        task={"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 1, **task},
    )


@pytest.mark.feature("C1")
def test_heartbeat_registers_node_with_inventory(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat(gpus=[A10, {**A10, "index": 1}])
    nodes = api.client.get("/api/v1/nodes", headers=admin).json()
    assert [n["id"] for n in nodes] == [node_id]
    n = nodes[0]
    assert n["status"] == "online" and len(n["gpus"]) == 2
    assert n["memory_total_mb"] == 16384 and n["cpu_count"] == 4
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    assert api.client.get("/api/v1/nodes", headers=admin).json()[0]["status"] == "offline"
    # a second heartbeat under the same name is the same node
    assert api.heartbeat(gpus=[A10]) == node_id


@pytest.mark.feature("B3")
@pytest.mark.feature("P2")
def test_scheduler_places_on_cards_with_free_memory_and_allocates_ports(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat(gpus=[A10])
    g = api.client.post("/api/v1/task-groups", json=gpu_service(), headers=admin).json()
    assert api.app.scheduler.run_round().placed == 1
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=admin).json()
    assert t["status"] == "scheduled" and t["node_id"] == node_id and t["gpu_ids"] == [0]
    assert t["ports"] == [{"container_port": 8000, "host_port": 21000, "from_pool": True}]
    # 90% of the card is committed; another 90% does not fit in the remaining 10%
    g2 = api.client.post("/api/v1/task-groups", json=gpu_service("gsvc2"), headers=admin).json()
    assert api.app.scheduler.run_round().placed == 0
    t2 = api.client.get(f"/api/v1/tasks/{g2['tasks'][0]['id']}", headers=admin).json()
    assert t2["status"] == "pending"
    assert t2["status_message"].startswith("InsufficientResources")
    assert "90% of memory commitment left" in t2["status_message"]


@pytest.mark.feature("B2")
def test_reasons_name_type_mismatch_and_offline(api: Api) -> None:
    admin = api.login()
    api.heartbeat(gpus=[A10])
    g = api.client.post(
        "/api/v1/task-groups", json=gpu_service(gpu_type="H100"), headers=admin
    ).json()
    api.app.scheduler.run_round()
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=admin).json()
    assert "no card of type 'H100'" in t["status_message"]
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    api.app.scheduler.run_round()
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=admin).json()
    assert "offline" in t["status_message"] and t["status"] == "pending"


def test_cpu_tasks_are_placed_by_node_memory(api: Api) -> None:
    admin = api.login()
    api.heartbeat(gpus=[], memory_mb=4096)
    ok = api.client.post(
        "/api/v1/task-groups", json=service_body(name="c1", task={"memory_mb": 2048}), headers=admin
    )
    api.clock.advance(1)  # FIFO: c1 was first
    too_big = api.client.post(
        "/api/v1/task-groups", json=service_body(name="c2", task={"memory_mb": 3000}), headers=admin
    )
    assert api.app.scheduler.run_round().placed == 1
    assert (
        api.client.get(f"/api/v1/task-groups/{ok.json()['id']}", headers=admin).json()["status"]
        == "scheduling"
    )
    t = api.client.get(f"/api/v1/task-groups/{too_big.json()['id']}", headers=admin).json()
    assert "3000 MB of free memory" in t["tasks"][0]["status_message"]


@pytest.mark.feature("C1")
def test_claim_is_compare_and_set_and_reports_drive_the_group(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    hb = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": "node-a",
            "address": "127.0.0.1",
            "inventory": {"cpu_count": 4, "memory_total_mb": 16384},
        },
        headers={"Authorization": "Bearer node-token-for-tests"},
    ).json()
    assert [t["id"] for t in hb["tasks"]] == [task_id]
    assert hb["tasks"][0]["model_path"] == "tiny.gguf"
    first = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    second = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    assert first.status_code == 200 and second.status_code == 409
    assert (
        api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).json()["status"]
        == "scheduling"
    )
    # another node cannot claim or report it
    other = api.heartbeat(name="node-b")
    assert (
        api.agent_post(
            other, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"}
        ).status_code
        == 404
    )
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200
    assert (
        api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).json()["status"]
        == "running"
    )
    # the snapshot now routes to it
    snap = api.app.publisher.refresh()
    targets = next(iter(snap.routes.values()))
    assert [b.base_url for b in targets[0].backends] == ["http://127.0.0.1:21000"]
    # a crash report fails the task with the reason
    api.agent_post(
        node_id,
        f"/api/v1/agent/tasks/{task_id}/report",
        {"status": "failed", "message": "engine exited with code -9"},
    )
    t = api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()
    assert t["status"] == "failed" and "code -9" in t["status_message"]
    g2 = api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).json()
    assert g2["status"] == "failed"
    assert api.app.publisher.refresh().routes[next(iter(snap.routes))][0].backends == ()
    events = api.client.get(f"/api/v1/task-groups/{g['id']}/events", headers=admin).json()
    assert [e["to_status"] for e in events if e["kind"] == "task_status"] == [
        "scheduled",
        "starting",
        "running",
        "failed",
    ]


def test_stop_moves_a_running_task_to_stopping_then_the_agent_confirms(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    _, task_id = running_service(api, admin, node_id)
    r = api.client.post(f"/api/v1/tasks/{task_id}/stop", headers=admin)
    assert r.json()["status"] == "stopping"
    # no longer in the agent's desired list
    assert (
        api.client.post(
            "/api/v1/agent/heartbeat",
            json={
                "name": "node-a",
                "address": "127.0.0.1",
                "inventory": {"cpu_count": 4, "memory_total_mb": 16384},
            },
            headers={"Authorization": "Bearer node-token-for-tests"},
        ).json()["tasks"]
        == []
    )
    api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "stopped"})
    assert api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()["status"] == "stopped"
    # and its port is free for the next placement
    g2 = api.client.post(
        "/api/v1/task-groups", json=service_body(name="next"), headers=admin
    ).json()
    api.app.scheduler.run_round()
    t2 = api.client.get(f"/api/v1/tasks/{g2['tasks'][0]['id']}", headers=admin).json()
    assert t2["ports"][0]["host_port"] == 21000


def test_snapshot_route_needs_gateway_token_or_operator(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team-s", "sam")
    assert api.client.get("/api/v1/gateway/snapshot", headers=member).status_code == 401
    r = api.client.get(
        "/api/v1/gateway/snapshot", headers={"Authorization": "Bearer gw-token-for-tests"}
    )
    assert r.status_code == 200
    etag = r.headers["etag"]
    r2 = api.client.get(
        "/api/v1/gateway/snapshot",
        headers={"Authorization": "Bearer gw-token-for-tests", "If-None-Match": etag},
    )
    assert r2.status_code == 304


def test_an_exit_while_stopping_counts_as_stopped(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    g, task_id = running_service(api, admin, node_id)
    api.client.delete(f"/api/v1/task-groups/{g['id']}", headers=admin)
    r = api.agent_post(
        node_id,
        f"/api/v1/agent/tasks/{task_id}/report",
        {"status": "failed", "message": "engine exited with code -15"},
    )
    assert r.status_code == 200 and r.json()["status"] == "stopped"
    assert api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()["status"] == "stopped"
