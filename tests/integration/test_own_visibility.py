"""Members who see only their own services (N5, issue 16) and the tenant PATCH fields
that go with them, on both databases.

With ``members_see_own`` on, member m2 of a tenant is refused — 404, as if it were
another tenant's — every operation of the OpenAPI document on the objects member m1
created (the tenant-isolation walker of test_tenant_isolation_walk.py, run between two
members of one tenant), and m2's lists leave them out; m1 still sees them. Replicas
made by others (an operator's scale-out, the recovery loop's rebuild, the autoscaler)
belong to m1, who reads and scales them. Switched off, m2 sees the tenant's services
again. The tenant's token quota and the switch are stored and shown, their validation
names the field, and members cannot set them.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.db.tables import Task, User

from .conftest import Api
from .test_recovery import fail, recovery_round
from .test_scale import backend, create, report_load, run_all, scale
from .test_tenant_isolation_walk import (
    BODY_REF,
    GLOBAL,
    OBJECT,
    TOKEN_REFUSED,
    World,
    build_world,
    fill,
    hub_token,
    operations,
)

MEMBER_PASSWORD = "member-pass-1"  # as Api.member
# What m2 may read of m1's world: tenant-level facts (the tenant, its quota, users and
# dedicated nodes) stay tenant-wide.
TENANT_LEVEL = {
    "GET /api/v1/usage",  # an own-only member's report is their own (member_id forced)
    "GET /api/v1/tenants/{tenant_id}/quota",
    "GET /api/v1/nodes/{node_id}/inference-template",
    "GET /api/v1/nodes/{node_id}/series",  # issue 33: a node's, as its template
}
# Operator-only operations: a member gets 403 whoever's object it names.
OPERATORS_ONLY = {
    "PATCH /api/v1/tenants/{tenant_id}",
    "POST /api/v1/users",
    "GET /api/v1/sharing-groups/{group_id}",
    "DELETE /api/v1/sharing-groups/{group_id}",
    "POST /api/v1/sharing-groups/{group_id}/tenants",
    "DELETE /api/v1/sharing-groups/{group_id}/tenants/{tenant_id}",
    # registry credentials (H7): operators and tenant admins only; a member gets 403
    "POST /api/v1/registry-credentials",
    "GET /api/v1/registry-credentials/{credential_id}",
    "PATCH /api/v1/registry-credentials/{credential_id}",
    "DELETE /api/v1/registry-credentials/{credential_id}",
    # hub tokens (H9): the same
    "POST /api/v1/hub-tokens",
    "GET /api/v1/hub-tokens/{token_id}",
    "PATCH /api/v1/hub-tokens/{token_id}",
    "DELETE /api/v1/hub-tokens/{token_id}",
}
MACHINE = ("/api/v1/agent/", "/api/v1/gateway/s", "/api/v1/gateway/u",
           "/api/v1/gateway/activity", "/api/v1/gateway/wake")


def user_id(api: Api, username: str) -> str:
    with api.app.db.session() as s:
        uid = s.scalar(select(User.id).where(User.username == username))
    assert uid is not None
    return uid


def two_members(api: Api, admin: dict[str, str]) -> tuple[str, dict[str, str], dict[str, str]]:
    """A tenant with members m1 and m2: (tenant id, m1's headers, m2's)."""
    m1 = api.member(admin, "team", "m1")
    tenant_id = api.client.get("/api/v1/tenants", headers=m1).json()[0]["id"]
    r = api.client.post(
        "/api/v1/users",
        json={"username": "m2", "password": MEMBER_PASSWORD, "tenant_id": tenant_id},
        headers=admin,
    )
    assert r.status_code == 201, r.text
    return tenant_id, m1, api.login("m2", MEMBER_PASSWORD)


def see_own(api: Api, admin: dict[str, str], tenant_id: str, on: bool) -> None:
    r = api.client.patch(
        f"/api/v1/tenants/{tenant_id}", json={"members_see_own": on}, headers=admin
    )
    assert r.status_code == 200, r.text
    assert r.json()["members_see_own"] is on


def own_ids(a: World) -> dict[str, str]:
    """What m2 must never be shown of m1's world (the tenant-level ids excepted)."""
    return {
        "group": a.group_id, "task": a.task_id, "endpoint": a.endpoint_id,
        "route": a.route_id, "added route": a.added_route_id,
        "file request": a.file_request_id, "key prefix": a.key_prefix,
    }


def leaks(text: str, a: World, sent: str) -> list[str]:
    return [f"{kind} {v}" for kind, v in own_ids(a).items() if v in text and v not in sent]


# ---- the walk ---------------------------------------------------------------------------


@pytest.mark.feature("N5")
def test_an_own_only_member_is_refused_every_operation_on_another_members_objects(
    api: Api,
) -> None:
    admin = api.login()
    tenant_id, m1, m2 = two_members(api, admin)
    node_id = api.heartbeat()
    a = build_world(api, m1, "m1", "a-svc", node_id)
    b = build_world(api, m2, "m2", "b-svc", node_id)
    assert a.tenant_id == b.tenant_id == tenant_id
    sg = api.client.post("/api/v1/sharing-groups", json={"name": "sg"}, headers=admin)
    assert sg.status_code == 201, sg.text
    a.sharing_group_id = sg.json()["id"]
    r = api.client.post(f"/api/v1/sharing-groups/{a.sharing_group_id}/tenants",
                        json={"tenant_id": tenant_id}, headers=admin)
    assert r.status_code == 200, r.text
    r = api.client.post("/api/v1/registry-credentials", headers=admin, json={
        "registry_host": "a.example.com", "username": "a", "password": "a-pass-123",
        "tenant_id": tenant_id})
    assert r.status_code == 201, r.text
    a.registry_credential_id = r.json()["id"]
    a.hub_token_id = hub_token(api, admin, tenant_id)
    # switched off (the default), m2 sees m1's service: the walk below is not vacuous
    assert api.client.get(f"/api/v1/task-groups/{a.group_id}", headers=m2).status_code == 200
    see_own(api, admin, tenant_id, True)

    doc = api.client.get("/api/v1/openapi.json").json()
    known = operations(a, b)
    walked = [f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops]
    walked += ["GET /api/v1/openapi.json", "GET /api/v1/docs"]
    unknown = sorted(set(walked) - set(known))
    assert unknown == [], f"classify these new operations in the walker: {unknown}"
    # control: m1, the owner, reads every object the walk names (sharing groups and
    # registry credentials: admin)
    for op, (kind, _) in known.items():
        method, path = op.split(" ", 1)
        if kind == OBJECT and method == "GET" and "{" in path and "/agent/" not in path:
            by_operator = ("/api/v1/sharing-groups/", "/api/v1/registry-credentials/",
                           "/api/v1/hub-tokens/")
            owner = admin if path.startswith(by_operator) else m1
            r = api.client.get(fill(path, a), headers=owner)
            assert r.status_code == (409 if path.endswith("/content") else 200), (op, r.text)
    order = sorted(
        walked,
        key=lambda op: (known[op][0] != GLOBAL, op.startswith("DELETE")),
    )
    problems: list[str] = []
    for op in order:
        kind, kw = known[op]
        method, path = op.split(" ", 1)
        url = fill(path, a)
        r = api.client.request(method, url, **{**kw, "headers": {**m2, **kw.get("headers", {})}})
        sent = url + repr(kw)
        found = leaks(r.text, a, sent)
        if r.status_code >= 500:
            problems.append(f"{op}: {r.status_code}")
        elif kind == GLOBAL or op in TENANT_LEVEL:
            if not 200 <= r.status_code < 500 or found:
                problems.append(f"{op}: {r.status_code} leaks {found}")
        else:
            assert kind in (OBJECT, BODY_REF)
            if path.startswith(MACHINE):
                allowed = TOKEN_REFUSED
            else:
                allowed = {403} if op in OPERATORS_ONLY else {404}
            if r.status_code not in allowed or found:
                problems.append(f"{op}: {r.status_code} {r.text[:160]}")
    assert problems == []

    # m1 still sees and has everything; m2's lists show only m2's own
    task = api.client.get(f"/api/v1/tasks/{a.task_id}", headers=m1).json()
    assert (task["status"], task["draining"]) == ("running", False)
    assert {r["id"] for r in api.client.get("/api/v1/model-routes", headers=m1).json()} == {
        a.route_id, a.added_route_id,
    }
    assert [e["id"] for e in api.client.get("/api/v1/gateway/endpoints", headers=m1).json()] == [
        a.endpoint_id
    ]
    groups = api.client.get("/api/v1/task-groups", headers=m2).json()
    assert a.group_id not in {g["id"] for g in groups} and b.group_id in {g["id"] for g in groups}
    routes = api.client.get("/api/v1/model-routes", headers=m2).json()
    assert b.added_route_id in {r["id"] for r in routes}
    assert {r["group_id"] for r in routes} <= {g["id"] for g in groups} - {a.group_id}
    # an operator still sees both members' services
    every = {g["id"] for g in api.client.get("/api/v1/task-groups", headers=admin).json()}
    assert {a.group_id, b.group_id} <= every

    # switched off: m2 sees the tenant's services again, as before
    see_own(api, admin, tenant_id, False)
    assert a.group_id in {
        g["id"] for g in api.client.get("/api/v1/task-groups", headers=m2).json()
    }
    for url in (f"/api/v1/task-groups/{a.group_id}", f"/api/v1/tasks/{a.task_id}",
                f"/api/v1/tasks/{a.task_id}/logs", f"/api/v1/task-groups/{a.group_id}/events",
                f"/api/v1/file-requests/{a.file_request_id}"):
        assert api.client.get(url, headers=m2).status_code == 200, url
    assert a.endpoint_id in {
        e["id"] for e in api.client.get("/api/v1/gateway/endpoints", headers=m2).json()
    }


# ---- replicas made by others ----------------------------------------------------------


def created_by(api: Api, group_id: str) -> dict[str, str]:
    """task id -> its created_by, for every task of the group."""
    with api.app.db.session() as s:
        rows = s.scalars(select(Task).where(Task.group_id == group_id))
        return {t.id: t.created_by for t in rows}


def readable(api: Api, headers: dict[str, str], task_id: str) -> bool:
    t = api.client.get(f"/api/v1/tasks/{task_id}", headers=headers).status_code
    logs = api.client.get(f"/api/v1/tasks/{task_id}/logs", headers=headers).status_code
    assert {t, logs} <= {200, 404}, (t, logs)
    return t == logs == 200


@pytest.mark.feature("N5")
def test_replicas_an_operator_or_the_platform_adds_belong_to_the_groups_creator(
    api: Api,
) -> None:
    admin = api.login()
    tenant_id, m1, m2 = two_members(api, admin)
    see_own(api, admin, tenant_id, True)
    m1_id = user_id(api, "m1")
    node = api.heartbeat()
    gid = create(api, m1, max_replicas=3,
                 scale_policy={"metric": "inflight", "target": 2, "max_replicas": 3})["id"]
    run_all(api, node, m1, gid)
    assert scale(api, m2, gid, 2).status_code == 404  # m2 cannot scale it

    # an operator scales m1's service out: the new replicas are m1's
    r = scale(api, admin, gid, 3)
    assert r.status_code == 200, r.text
    added = [t["id"] for t in r.json()["tasks"] if t["rank"] > 0]
    assert len(added) == 2
    assert set(created_by(api, gid).values()) == {m1_id}
    run_all(api, node, m1, gid)  # m1 reads its group's tasks, the new ones included
    log = api.agent_post(node, f"/api/v1/agent/tasks/{added[0]}/logs", {"text": "rank 1 up"})
    assert log.status_code in (200, 201), log.text
    assert readable(api, m1, added[0]) and not readable(api, m2, added[0])
    chunks = api.client.get(f"/api/v1/tasks/{added[0]}/logs", headers=m1).json()["chunks"]
    assert [c["text"] for c in chunks] == ["rank 1 up"]
    # ... and m1 scales them back in
    r = scale(api, m1, gid, 1)
    assert r.status_code == 200, r.text
    assert r.json()["current_replicas"] == 1

    # the recovery loop rebuilds m1's failed replica: the rebuild is m1's
    [rank0] = [t["id"] for t in r.json()["tasks"]]
    fail(api, node, rank0)
    result = recovery_round(api)
    assert len(result.rebuilt) == 1, result
    [rebuilt] = result.rebuilt
    assert created_by(api, gid)[rebuilt] == m1_id
    assert readable(api, m1, rebuilt) and not readable(api, m2, rebuilt)
    run_all(api, node, m1, gid)

    # the autoscaler scales out under load: the new replicas are m1's too
    report_load(api, [backend(rebuilt, gid, 9)])
    api.app.leadership.reconcile_once(api.clock.now())
    outcomes = {o.group_id: o for o in api.app.autoscaler.run_round()}
    scaled = outcomes[gid].scaled
    assert scaled is not None and len(scaled.added) == 2
    owners = created_by(api, gid)
    assert {owners[t] for t in scaled.added} == {m1_id}
    for t in scaled.added:
        assert readable(api, m1, t) and not readable(api, m2, t)
    g = api.client.get(f"/api/v1/task-groups/{gid}", headers=m1).json()
    assert {t["id"] for t in g["tasks"]} == {rebuilt, *scaled.added}


@pytest.mark.feature("N5")
def test_an_own_only_member_lists_and_manages_only_their_own(api: Api) -> None:
    admin = api.login()
    tenant_id, m1, m2 = two_members(api, admin)
    see_own(api, admin, tenant_id, True)
    node = api.heartbeat()
    g1 = create(api, m1, name="one")
    g2 = create(api, m2, name="two")
    run_all(api, node, m1, g1["id"])
    run_all(api, node, m2, g2["id"])
    t1 = g1["tasks"][0]["id"]

    assert [g["id"] for g in api.client.get("/api/v1/task-groups", headers=m1).json()] == [
        g1["id"]
    ]
    assert [g["id"] for g in api.client.get("/api/v1/task-groups", headers=m2).json()] == [
        g2["id"]
    ]
    assert [e["group_id"] for e in api.client.get(
        "/api/v1/gateway/endpoints", headers=m2).json()] == [g2["id"]]
    for method, url in (
        ("POST", f"/api/v1/task-groups/{g1['id']}/stop"),
        ("POST", f"/api/v1/task-groups/{g1['id']}/sleep"),
        ("POST", f"/api/v1/tasks/{t1}/sleep"),
        ("POST", f"/api/v1/tasks/{t1}/stop"),
        ("GET", f"/api/v1/task-groups/{g1['id']}/schedule-window"),
    ):
        r = api.client.request(method, url, headers=m2)
        assert r.status_code == 404, (url, r.text)
        assert "not found" in r.json()["error"]["message"]
    # a route of m2's own to m1's service is refused as if the service did not exist
    r = api.client.post("/api/v1/model-routes", json={"model_name": "x", "group_id": g1["id"]},
                        headers=m2)
    assert r.status_code == 404, r.text
    # m1 manages its own: sleep, wake, stop
    r = api.client.post(f"/api/v1/task-groups/{g1['id']}/sleep", headers=m1)
    assert r.status_code == 202 and r.json()["slept"] == [t1], r.text
    r = api.client.post(f"/api/v1/task-groups/{g1['id']}/wake", headers=m1)
    assert r.status_code == 202, r.text
    r = api.client.post(f"/api/v1/task-groups/{g1['id']}/stop", headers=m1)
    assert r.status_code == 200 and r.json()["desired"] == "stopped", r.text


@pytest.mark.feature("N5", "L2")
def test_dedup_reuses_only_an_own_only_members_own_services(api: Api) -> None:
    """Another member's service would answer with a group the caller may not see."""
    admin = api.login()
    tenant_id, m1, m2 = two_members(api, admin)
    see_own(api, admin, tenant_id, True)
    r = api.client.put("/api/v1/platform-settings", json={"inference_dedup_enabled": True},
                       headers=admin)
    assert r.status_code == 200, r.text
    node = api.heartbeat()
    g1 = create(api, m1, name="one")
    run_all(api, node, m1, g1["id"])

    mine = create(api, m2, name="two")  # the same model and image as m1's running one
    assert mine.get("dedup") is None and mine["id"] != g1["id"]
    assert "m1" not in str(mine) and g1["id"] not in str(mine)
    again = create(api, m1, name="three")  # m1's own is reused
    assert again["dedup"]["group_id"] == g1["id"]

    see_own(api, admin, tenant_id, False)  # tenant-wide again: m2 reuses the oldest
    shared = create(api, m2, name="four")
    assert shared["dedup"]["group_id"] == g1["id"]


# ---- the tenant PATCH fields ------------------------------------------------------------


def patch(api: Api, headers: dict[str, str], tenant_id: str, **body: Any) -> Any:
    return api.client.patch(f"/api/v1/tenants/{tenant_id}", json=body, headers=headers)


@pytest.mark.feature("N5")
def test_operators_set_the_token_quota_and_the_switch_members_cannot(api: Api) -> None:
    admin = api.login()
    tenant_id, m1, _ = two_members(api, admin)
    shown = api.client.get("/api/v1/tenants", headers=m1).json()[0]
    assert (shown["quota_tokens"], shown["quota_token_period"], shown["members_see_own"]) == (
        0, "", False,
    )
    r = patch(api, admin, tenant_id, quota_tokens=10**6, quota_token_period="month",
              members_see_own=True)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["quota_tokens"], got["quota_token_period"], got["members_see_own"]) == (
        10**6, "month", True,
    )
    listed = api.client.get("/api/v1/tenants", headers=admin).json()
    [row] = [t for t in listed if t["id"] == tenant_id]
    assert (row["quota_tokens"], row["quota_token_period"], row["members_see_own"]) == (
        10**6, "month", True,
    )
    # fields left out stay; 0 clears the quota, whatever its period
    r = patch(api, admin, tenant_id, quota_tokens=0)
    assert r.status_code == 200, r.text
    assert (r.json()["quota_tokens"], r.json()["quota_token_period"]) == (0, "month")
    assert r.json()["members_see_own"] is True
    # members never set them
    r = patch(api, m1, tenant_id, members_see_own=False)
    assert r.status_code == 403, r.text
    [row] = [t for t in api.client.get("/api/v1/tenants", headers=admin).json()
             if t["id"] == tenant_id]
    assert row["members_see_own"] is True


@pytest.mark.feature("N5")
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"quota_tokens": 5, "quota_token_period": ""}, "quota_token_period"),
        ({"quota_token_period": "week"}, "quota_token_period"),
        ({"quota_tokens": -1}, "quota_tokens"),
        ({"quota_tokens": 10**15 + 1}, "quota_tokens"),
        ({"members_see_own": "sometimes"}, "members_see_own"),
        ({"members_see_own": None}, "members_see_own"),
    ],
)
def test_tenant_patch_validation_names_the_field(
    api: Api, body: dict[str, Any], field: str
) -> None:
    admin = api.login()
    tenant_id, _, _ = two_members(api, admin)
    r = patch(api, admin, tenant_id, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    # nothing was written
    [row] = [t for t in api.client.get("/api/v1/tenants", headers=admin).json()
             if t["id"] == tenant_id]
    assert (row["quota_tokens"], row["quota_token_period"], row["members_see_own"]) == (
        0, "", False,
    )
