"""PATCH /api/v1/task-groups/{id} (D4): the health check and the idle timeout change
alone — no generation bump, no new task — and the agents' assignments carry the new
health check at their next heartbeat."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import NODE_TOKEN, Api, service_body
from .test_fault_events import create, events, start


def patch(api: Api, headers: dict[str, str], group_id: str, body: dict[str, Any]) -> Any:
    return api.client.patch(f"/api/v1/task-groups/{group_id}", json=body, headers=headers)


def assignments(api: Api) -> list[dict[str, Any]]:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "allowed_volume_prefixes": ["/data/models"],
              "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return list(r.json()["tasks"])


@pytest.mark.feature("D4")
def test_health_check_and_idle_timeout_change_alone(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, first = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, first)
    before = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()
    assert assignments(api)[0]["health_check"]["interval_seconds"] == 10

    health = {"path": "/v1/models", "interval_seconds": 5, "unhealthy_threshold": 2}
    r = patch(api, admin, group_id, {"health_check": health, "idle_timeout_minutes": 15})
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["health_check"]["path"] == "/v1/models"
    assert g["health_check"]["interval_seconds"] == 5
    assert g["health_check"]["port"] == 8000  # defaults to the first container port
    assert g["idle_timeout_minutes"] == 15
    # no generation bump, no new task, nothing restarted
    assert g["current_generation"] == before["current_generation"] == 1
    assert [(t["id"], t["generation"], t["status"]) for t in g["tasks"]] == [
        (first, 1, "running")
    ]
    # the agent's next heartbeat carries it
    (a,) = assignments(api)
    assert a["id"] == first and a["health_check"]["path"] == "/v1/models"
    assert a["health_check"]["unhealthy_threshold"] == 2
    changed = [e for e in events(api, admin, group_id) if e["kind"] == "group.config_changed"]
    assert len(changed) == 1 and "changed by admin" in changed[0]["message"]
    assert "/v1/models" in changed[0]["message"] and "idle timeout 15 min" in changed[0]["message"]

    r = patch(api, admin, group_id, {"idle_timeout_minutes": 0})  # one field alone
    assert r.status_code == 200 and r.json()["idle_timeout_minutes"] == 0
    assert r.json()["health_check"]["path"] == "/v1/models"  # untouched


@pytest.mark.feature("D4")
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "other"}, "name"),
        ({"priority": 5}, "priority"),
        ({"idle_timeout_minutes": 5, "gpu_memory_utilization": 50}, "gpu_memory_utilization"),
        ({"task": {"image": "x"}}, "task"),
        ({"run_timeout_seconds": 60}, "run_timeout_seconds"),
        ({"health_check": {"interval_seconds": 5, "bogus": 1}}, "health_check.bogus"),
        ({"health_check": {"port": 9999}}, "health_check.port"),
        ({"idle_timeout_minutes": -1}, "idle_timeout_minutes"),
        ({}, "health_check"),
    ],
)
def test_any_other_field_is_400_naming_it(
    api: Api, body: dict[str, Any], field: str
) -> None:
    admin = api.login()
    api.heartbeat()
    group_id, _ = create(api, admin, service_body())
    r = patch(api, admin, group_id, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    g = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()
    assert g["idle_timeout_minutes"] == 0 and g["health_check"]["interval_seconds"] == 10


def test_patch_is_404_for_other_tenants_and_deleted_groups(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    group_id, _ = create(api, admin, service_body())
    outsider = api.member(admin, "other", "mallory")
    assert patch(api, outsider, group_id, {"idle_timeout_minutes": 1}).status_code == 404
    assert api.client.delete(f"/api/v1/task-groups/{group_id}", headers=admin).status_code == 204
    assert patch(api, admin, group_id, {"idle_timeout_minutes": 1}).status_code == 404
