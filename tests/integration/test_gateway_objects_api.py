"""Endpoints (keys) and model routes after creation; tenants and visibility."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, service_body


@pytest.mark.feature("A3")
def test_rotate_key_returns_a_new_key_once(api: Api) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    eps = api.client.get("/api/v1/gateway/endpoints", headers=admin).json()
    assert [e["id"] for e in eps] == [g["endpoint"]]
    assert eps[0]["key_prefix"] == g["api_key"][:7] + "…"
    r = api.client.put(
        f"/api/v1/gateway/endpoints/{g['endpoint']}", json={"rotate_key": True}, headers=admin
    )
    assert r.status_code == 200
    new = r.json()["api_key"]
    assert new.startswith("sk-") and new != g["api_key"]
    r = api.client.put(f"/api/v1/gateway/endpoints/{g['endpoint']}", json={}, headers=admin)
    assert r.json()["api_key"] is None


@pytest.mark.feature("A1")
def test_deleting_the_endpoint_clears_the_group_reference(api: Api) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    assert (
        api.client.delete(f"/api/v1/gateway/endpoints/{g['endpoint']}", headers=admin).status_code
        == 204
    )
    assert (
        api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).json()["endpoint"] is None
    )


@pytest.mark.feature("A4")
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"weight": 101}, "weight"),
        ({"weight": -1}, "weight"),
        ({"algorithm": "fastest"}, "algorithm"),
        ({"priority": -1}, "priority"),
    ],
)
def test_route_update_validation_for_members(
    api: Api, body: dict[str, Any], field: str
) -> None:
    admin = api.login()
    member = api.member(admin, "team-r", "rita")
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=member).json()
    route = api.client.get(f"/api/v1/model-routes?group_id={g['id']}", headers=member).json()[0]
    r = api.client.put(f"/api/v1/model-routes/{route['id']}", json=body, headers=member)
    assert r.status_code == 400 and r.json()["error"]["field"] == field


def test_operator_may_set_negative_priority_and_weights_apply(api: Api) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    route = api.client.get("/api/v1/model-routes", headers=admin).json()[0]
    r = api.client.put(
        f"/api/v1/model-routes/{route['id']}",
        json={"priority": -5, "weight": 0, "version": "canary", "algorithm": "least_connections"},
        headers=admin,
    )
    assert r.status_code == 200, r.text
    assert (r.json()["priority"], r.json()["weight"], r.json()["version"]) == (-5, 0, "canary")
    assert g["id"] == r.json()["group_id"]


@pytest.mark.feature("N1")
def test_members_see_only_their_tenant(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    bob = api.member(admin, "team-b", "bob")
    ga = api.client.post("/api/v1/task-groups", json=service_body(), headers=alice).json()
    task_id = ga["tasks"][0]["id"]
    assert api.client.get(f"/api/v1/task-groups/{ga['id']}", headers=bob).status_code == 404
    assert api.client.delete(f"/api/v1/task-groups/{ga['id']}", headers=bob).status_code == 404
    assert api.client.get(f"/api/v1/tasks/{task_id}", headers=bob).status_code == 404
    assert api.client.post(f"/api/v1/tasks/{task_id}/stop", headers=bob).status_code == 404
    assert api.client.get("/api/v1/task-groups", headers=bob).json() == []
    assert api.client.get("/api/v1/gateway/endpoints", headers=bob).json() == []
    r = api.client.put(
        f"/api/v1/gateway/endpoints/{ga['endpoint']}", json={"rotate_key": True}, headers=bob
    )
    assert r.status_code == 404
    # the operator sees everything
    assert [g["id"] for g in api.client.get("/api/v1/task-groups", headers=admin).json()] == [
        ga["id"]
    ]
    # members cannot create tenants or users
    assert api.client.post("/api/v1/tenants", json={"name": "x"}, headers=bob).status_code == 403
    assert (
        api.client.post(
            "/api/v1/users", json={"username": "eve", "password": "12345678"}, headers=bob
        ).status_code
        == 403
    )
    assert [t["name"] for t in api.client.get("/api/v1/tenants", headers=bob).json()] == ["team-b"]


@pytest.mark.feature("N1")
def test_auth_is_required_and_checked(api: Api) -> None:
    assert api.client.get("/api/v1/task-groups").status_code == 401
    assert (
        api.client.get(
            "/api/v1/task-groups", headers={"Authorization": "Bearer not-a-jwt"}
        ).status_code
        == 401
    )
    r = api.client.post("/api/v1/auth/login", json={"username": "admin", "password": "wrong"})
    assert r.status_code == 401
    assert (
        api.client.post(
            "/api/v1/agent/heartbeat", json={}, headers={"Authorization": "Bearer wrong"}
        ).status_code
        == 401
    )
    # an expired token stops working
    admin = api.login()
    api.clock.advance(api.app.settings.jwt_ttl_s + 1)
    assert api.client.get("/api/v1/task-groups", headers=admin).status_code == 401


@pytest.mark.feature("N1")
def test_duplicate_tenant_and_user_are_409(api: Api) -> None:
    admin = api.login()
    api.member(admin, "team-d", "dave")
    assert (
        api.client.post("/api/v1/tenants", json={"name": "team-d"}, headers=admin).status_code
        == 409
    )
    r = api.client.post(
        "/api/v1/users", json={"username": "dave", "password": "12345678"}, headers=admin
    )
    assert r.status_code == 409 and r.json()["error"]["field"] == "username"


def test_openapi_document_lists_the_routes(api: Api) -> None:
    doc = api.client.get("/api/v1/openapi.json").json()
    for path in (
        "/api/v1/task-groups",
        "/api/v1/task-groups/{group_id}",
        "/api/v1/tasks/{task_id}/stop",
        "/api/v1/gateway/endpoints",
        "/api/v1/gateway/endpoints/{endpoint_id}",
        "/api/v1/model-routes/{route_id}",
        "/api/v1/nodes",
        "/api/v1/auth/login",
        "/api/v1/tenants",
        "/api/v1/users",
    ):
        assert path in doc["paths"], path


@pytest.mark.feature("M15")
def test_a_new_route_balances_by_prompt_prefix_unless_it_names_another_algorithm(
    api: Api,
) -> None:
    """Issue 30: prefix_affinity is the default for new routes — a service's own and one
    added without an algorithm — while one that names its algorithm keeps it."""
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    own = api.client.get(f"/api/v1/model-routes?group_id={g['id']}", headers=admin).json()
    assert [r["algorithm"] for r in own] == ["prefix_affinity"]
    added = api.client.post(
        "/api/v1/model-routes", json={"model_name": "alias", "group_id": g["id"]}, headers=admin
    )
    assert added.status_code in (200, 201), added.text
    assert added.json()["algorithm"] == "prefix_affinity"
    named = api.client.post(
        "/api/v1/model-routes",
        json={"model_name": "rr", "group_id": g["id"], "algorithm": "round_robin"},
        headers=admin,
    )
    assert named.json()["algorithm"] == "round_robin"
