"""Draining through the management API (M11), and the routing facts the snapshot carries
for the gateway's policy: draining, card temperatures (M4) and route tags (M10)."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.schemas.routing import Backend

from .conftest import Api, service_body

A10 = {"index": 0, "vendor": "nvidia", "model": "A10", "memory_total_mb": 24576}


def _running(api: Api, headers: dict[str, str], node_id: str, **over: Any) -> dict[str, Any]:
    """A service whose only task was placed, claimed and reported running."""
    r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=headers)
    g: dict[str, Any] = r.json()
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200
    return g


def _backends(api: Api) -> list[Backend]:
    snap = api.app.publisher.refresh()
    return [b for targets in snap.routes.values() for t in targets for b in t.backends]


@pytest.mark.feature("M11")
def test_drain_marks_the_backend_and_delete_clears_it(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    g = _running(api, admin, node_id)
    task_id = g["tasks"][0]["id"]
    assert [b.draining for b in _backends(api)] == [False]

    r = api.client.post(f"/api/v1/tasks/{task_id}/drain", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["draining"] is True and r.json()["status"] == "running"
    assert api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()["draining"] is True
    assert [b.draining for b in _backends(api)] == [True]
    # the wire form a separate gateway polls carries it too
    wire = api.client.get(
        "/api/v1/gateway/snapshot", headers={"Authorization": "Bearer gw-token-for-tests"}
    ).json()
    assert wire["routes"][0]["targets"][0]["backends"][0]["draining"] is True
    # idempotent; the task keeps running (in-flight requests finish on it)
    assert api.client.post(f"/api/v1/tasks/{task_id}/drain", headers=admin).status_code == 200

    r = api.client.delete(f"/api/v1/tasks/{task_id}/drain", headers=admin)
    assert r.status_code == 200 and r.json()["draining"] is False
    assert [b.draining for b in _backends(api)] == [False]
    events = api.client.get(f"/api/v1/task-groups/{g['id']}/events", headers=admin).json()
    drains = [(e["kind"], e["message"]) for e in events if e["kind"] in ("drain", "undrain")]
    assert drains == [("drain", "draining by admin"), ("undrain", "draining cleared by admin")]


@pytest.mark.feature("M11")
def test_members_drain_only_their_tenants_tasks(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    bob = api.member(admin, "team-b", "bob")
    node_id = api.heartbeat()
    task_id = _running(api, alice, node_id)["tasks"][0]["id"]
    for method in ("post", "delete"):
        r = getattr(api.client, method)(f"/api/v1/tasks/{task_id}/drain", headers=bob)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"
    assert api.client.post("/api/v1/tasks/no-such-task/drain", headers=alice).status_code == 404
    assert api.client.post(f"/api/v1/tasks/{task_id}/drain").status_code == 401
    assert [b.draining for b in _backends(api)] == [False]
    r = api.client.post(f"/api/v1/tasks/{task_id}/drain", headers=alice)
    assert r.status_code == 200 and r.json()["draining"] is True


@pytest.mark.feature("M11")
def test_a_task_that_ended_cannot_be_drained(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = _running(api, admin, node_id)["tasks"][0]["id"]
    api.agent_post(
        node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "failed", "message": "x"}
    )
    r = api.client.post(f"/api/v1/tasks/{task_id}/drain", headers=admin)
    assert r.status_code == 409
    assert "failed" in r.json()["error"]["message"]
    # clearing is always allowed (and a no-op here)
    assert api.client.delete(f"/api/v1/tasks/{task_id}/drain", headers=admin).status_code == 200


@pytest.mark.feature("M16")
def test_the_snapshot_carries_the_slots_the_engines_arguments_set(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    g = _running(api, admin, node_id, name="slotted", task={"engine_args": ["-np", "3"]})
    assert [b.slots for b in _backends(api)] == [3]  # llama.cpp's -np: the fair-share bound
    wire = api.client.get(
        "/api/v1/gateway/snapshot", headers={"Authorization": "Bearer gw-token-for-tests"}
    ).json()
    assert wire["routes"][0]["targets"][0]["backends"][0]["slots"] == 3
    # the service page's replica row counts in flight against the same slots
    (row,) = api.client.get(f"/api/v1/task-groups/{g['id']}/series", headers=admin).json()[
        "replicas"]
    assert row["slots"] == 3


@pytest.mark.feature("M4")
def test_the_snapshot_carries_the_hottest_card_of_the_task(api: Api) -> None:
    admin = api.login()
    gpus = [{**A10, "temperature_c": 71}, {**A10, "index": 1, "temperature_c": 88}]
    node_id = api.heartbeat(gpus=gpus)
    gpu = {"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 2}
    _running(api, admin, node_id, name="gsvc", task=gpu)
    assert [b.temperature_c for b in _backends(api)] == [88]
    # the next heartbeat's reading reaches the next snapshot
    api.heartbeat(gpus=[{**A10, "temperature_c": 60}, {**A10, "index": 1, "temperature_c": 62}])
    assert [b.temperature_c for b in _backends(api)] == [62]


@pytest.mark.feature("M4")
def test_cpu_task_or_unknown_temperature_is_none(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat(gpus=[A10])  # declared card: no temperature
    _running(api, admin, node_id)
    assert [b.temperature_c for b in _backends(api)] == [None]


@pytest.mark.feature("M10")
def test_route_tags_are_set_validated_and_published(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    g = _running(api, admin, node_id)
    route = api.client.get(f"/api/v1/model-routes?group_id={g['id']}", headers=admin).json()[0]
    assert route["tags"] == []
    r = api.client.put(
        f"/api/v1/model-routes/{route['id']}",
        json={"tags": ["long-context", "code", "code"]},
        headers=admin,
    )
    assert r.status_code == 200, r.text
    assert r.json()["tags"] == ["code", "long-context"]
    snap = api.app.publisher.refresh()
    assert [t.tags for ts in snap.routes.values() for t in ts] == [("code", "long-context")]
    bad = api.client.put(
        f"/api/v1/model-routes/{route['id']}", json={"tags": ["Has Space"]}, headers=admin
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["field"].startswith("tags")
