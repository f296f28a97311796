"""Routes added for a tenant (A3, M3): every key of the tenant may call their model; a
second group under one model name is a canary; operators can share a group's model
with another tenant of its sharing group."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.schemas.routing import RoutingSnapshot, hash_key
from heteroflow.services.serving.routing import build_snapshot

from .conftest import Api, service_body


def snapshot(api: Api) -> RoutingSnapshot:
    with api.app.db.session() as s:
        return build_snapshot(s, 1)


def models_of(api: Api, key: str) -> set[str]:
    return set(snapshot(api).keys[hash_key(key)].models)


def group(api: Api, headers: dict[str, str], name: str) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=service_body(name=name, model_name=name),
                        headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


@pytest.mark.feature("M3")
def test_a_route_added_for_the_tenant_is_callable_by_all_its_keys(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "acme", "ann")
    a, b = group(api, member, "alpha"), group(api, member, "beta")
    assert models_of(api, a["api_key"]) == {"alpha"}
    r = api.client.post("/api/v1/model-routes", headers=member,
                        json={"model_name": "shared-chat", "group_id": b["id"], "weight": 90})
    assert r.status_code == 201, r.text
    assert r.json()["added"] is True and r.json()["weight"] == 90
    assert models_of(api, a["api_key"]) == {"alpha", "shared-chat"}
    assert models_of(api, b["api_key"]) == {"beta", "shared-chat"}
    # a canary: the same model name on a second group, priority and weight split it
    r2 = api.client.post("/api/v1/model-routes", headers=member,
                         json={"model_name": "shared-chat", "group_id": a["id"], "weight": 10})
    assert r2.status_code == 201
    targets = snapshot(api).routes[(a["tenant_id"], "shared-chat")]
    assert [(t.group_id, t.weight) for t in targets] == [(b["id"], 90), (a["id"], 10)]
    # removing the added route takes the model away from the keys again
    assert api.client.delete(f"/api/v1/model-routes/{r.json()['id']}",
                             headers=member).status_code == 204
    assert api.client.delete(f"/api/v1/model-routes/{r2.json()['id']}",
                             headers=member).status_code == 204
    assert models_of(api, a["api_key"]) == {"alpha"}


def test_added_route_errors_name_the_field(api: Api) -> None:
    admin = api.login()
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    mine, theirs = group(api, one, "mine"), group(api, two, "theirs")
    def post(body: dict[str, Any], h: dict[str, str] = one) -> Any:
        return api.client.post("/api/v1/model-routes", json=body, headers=h)

    r = post({"model_name": "x", "group_id": theirs["id"]})
    assert r.status_code == 404 and theirs["id"] in r.text  # another tenant's group: unseen
    r = post({"model_name": "x", "group_id": mine["id"], "tenant_id": theirs["tenant_id"]})
    assert r.status_code == 404
    assert post({"model_name": "x", "group_id": mine["id"], "weight": 101}).status_code == 400
    r = post({"model_name": "x", "group_id": mine["id"], "algorithm": "fastest"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "algorithm"
    assert post({"model_name": "x", "group_id": mine["id"], "priority": -1}).status_code == 400
    assert post({"model_name": "x", "group_id": mine["id"]}).status_code == 201
    r = post({"model_name": "x", "group_id": mine["id"]})
    assert r.status_code == 409 and r.json()["error"]["field"] == "model_name"
    auto = api.client.get(f"/api/v1/model-routes?group_id={mine['id']}", headers=one).json()
    created_with_group = next(x for x in auto if not x["added"])
    r = api.client.delete(f"/api/v1/model-routes/{created_with_group['id']}", headers=one)
    assert r.status_code == 409


@pytest.mark.feature("N1")
def test_an_operator_shares_a_model_with_another_tenant(api: Api) -> None:
    admin = api.login()
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    provider, consumer = group(api, one, "provider"), group(api, two, "consumer")
    # issue 16 (L4): only between tenants of one sharing group (test_dedup.py: refusals)
    sg = api.client.post("/api/v1/sharing-groups", json={"name": "pool"}, headers=admin)
    for tenant in (provider["tenant_id"], consumer["tenant_id"]):
        joined = api.client.post(f"/api/v1/sharing-groups/{sg.json()['id']}/tenants",
                                 json={"tenant_id": tenant}, headers=admin)
        assert joined.status_code == 200, joined.text
    r = api.client.post("/api/v1/model-routes", headers=admin, json={
        "model_name": "platform-llm", "group_id": provider["id"],
        "tenant_id": consumer["tenant_id"]})
    assert r.status_code == 201, r.text
    assert "platform-llm" in models_of(api, consumer["api_key"])
    assert "platform-llm" not in models_of(api, provider["api_key"])  # routed for "two" only
    target = snapshot(api).routes[(consumer["tenant_id"], "platform-llm")][0]
    assert target.group_id == provider["id"]
