"""Tenant isolation, operation by operation (issue 10): the walker covers the whole API.

Tenant A builds a world — a task group whose task runs on a node and has logs, its
endpoint and key, the route made with it and one added, a file request, token usage, a
node dedicated to A. Then a member of tenant B sends EVERY operation of the OpenAPI
document (``/api/v1/openapi.json``): path parameters filled with A's real ids, a minimal
valid body where one is needed. Operations on A's objects must be refused (404, or 403
where only an operator may act; 401 where the operation takes another kind of token);
global operations (login, lists, health, the document itself) must answer without one of
A's ids in the body. A new operation the walker does not know fails the test until it is
classified here, so every future route is walked too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from heteroflow.core.paths import task_roots
from heteroflow.db.tables import User

from .conftest import NODE_TOKEN, Api, service_body

GATEWAY_TOKEN = "gw-token-for-tests"  # the api fixture's
PARAM = re.compile(r"\{(\w+)\}")


@dataclass
class World:
    """One tenant's objects, by kind, made through the API."""

    who: dict[str, str]
    tenant_id: str
    user_id: str
    group_id: str
    task_id: str
    endpoint_id: str
    route_id: str  # made with the group
    added_route_id: str  # added afterwards (deletable)
    file_request_id: str
    node_id: str  # the node the task runs on (shared)
    dedicated_node_id: str  # a node dedicated to this tenant
    key_prefix: str
    sharing_group_id: str = ""  # an operator's sharing group holding this tenant
    registry_credential_id: str = ""  # an operator's registry credential (H7)
    hub_token_id: str = ""  # an operator's hub token for this tenant (H9)

    def ids(self) -> dict[str, str]:
        """What another tenant must never be shown (the shared node is not among them)."""
        return {
            "tenant": self.tenant_id, "user": self.user_id, "group": self.group_id,
            "task": self.task_id, "endpoint": self.endpoint_id, "route": self.route_id,
            "added route": self.added_route_id, "file request": self.file_request_id,
            "dedicated node": self.dedicated_node_id, "key prefix": self.key_prefix,
            **({"registry credential": self.registry_credential_id}
               if self.registry_credential_id else {}),
            **({"hub token": self.hub_token_id} if self.hub_token_id else {}),
        }


def agent(api: Api, node_id: str, method: str, path: str, **kw: Any) -> Any:
    headers = {"Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node_id}
    return api.client.request(method, path, headers=headers, **kw)


def build_world(
    api: Api, who: dict[str, str], username: str, name: str, node_id: str
) -> World:
    """A running task with logs, endpoint, routes, a file request and usage."""
    with api.app.db.session() as s:
        user_id = s.scalar(select(User.id).where(User.username == username))
    assert user_id is not None
    g = api.client.post("/api/v1/task-groups", json=service_body(name=name), headers=who)
    assert g.status_code == 201, g.text
    group = g.json()
    task = group["tasks"][0]
    api.app.scheduler.run_round()
    for path, body in ((f"/api/v1/agent/tasks/{task['id']}/claim", {}),
                       (f"/api/v1/agent/tasks/{task['id']}/report", {"status": "running"}),
                       (f"/api/v1/agent/tasks/{task['id']}/logs", {"text": f"{name} says hi"})):
        r = agent(api, node_id, "POST", path, json=body)
        assert r.status_code in (200, 201), r.text
    placed = api.client.get(f"/api/v1/tasks/{task['id']}", headers=who).json()
    assert placed["status"] == "running", placed
    root = task_roots(placed["model_path"], placed["engine"], "docker")[0]
    fr = api.client.post(
        "/api/v1/file-requests",
        json={"task_id": task["id"], "request_type": "list", "target_path": root},
        headers=who,
    )
    assert fr.status_code == 201, fr.text
    routes = api.client.get("/api/v1/model-routes", headers=who).json()
    added = api.client.post(
        "/api/v1/model-routes",
        json={"model_name": f"{name}-alias", "group_id": group["id"]},
        headers=who,
    )
    assert added.status_code == 201, added.text
    endpoint = api.client.get("/api/v1/gateway/endpoints", headers=who).json()[0]
    usage = {"records": [{
        "endpoint_id": endpoint["id"], "tenant_id": group["tenant_id"], "model": name,
        "requests": 1, "prompt_tokens": 2, "completion_tokens": 3,
        "recorded_at": "2026-01-01T00:00:00Z",
    }]}
    r = api.client.post("/api/v1/gateway/usage", json=usage,
                        headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"})
    assert r.status_code == 200, r.text
    dedicated = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": f"{name}-only", "address": "127.0.0.1", "inventory": {},
              "labels": {"heteroflow.tenants": group["tenant_id"]}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert dedicated.status_code == 200, dedicated.text
    return World(
        who=who, tenant_id=group["tenant_id"], user_id=user_id, group_id=group["id"],
        task_id=task["id"], endpoint_id=endpoint["id"], route_id=routes[0]["id"],
        added_route_id=added.json()["id"], file_request_id=fr.json()["id"], node_id=node_id,
        dedicated_node_id=dedicated.json()["node_id"], key_prefix=endpoint["key_prefix"],
    )


# --- the classification of every operation -------------------------------------------
# OBJECT: touches the other tenant's object named by the path -> 403/404 (401: the
#   operation takes a node or gateway token, which a member does not hold).
# BODY_REF: names the other tenant's object in the body or query -> 403/404.
# GLOBAL: answers for the caller only -> any 2xx/4xx, and none of A's ids in the body.

OBJECT, BODY_REF, GLOBAL = "object", "body-ref", "global"
REFUSED = {OBJECT: {403, 404}, BODY_REF: {403, 404}}
TOKEN_REFUSED = {401, 403, 404}


def operations(a: World, b: World) -> dict[str, tuple[str, dict[str, Any]]]:
    """``"METHOD /path"`` -> (kind, request keywords). Path ids are filled separately."""
    return {
        "POST /api/v1/auth/login": (GLOBAL, {"json": {"username": "bob",
                                                      "password": "member-pass-1"}}),
        "GET /healthz": (GLOBAL, {}),
        "GET /api/v1/tenants": (GLOBAL, {}),
        "POST /api/v1/tenants": (GLOBAL, {"json": {"name": "mine-now"}}),
        "PATCH /api/v1/tenants/{tenant_id}": (OBJECT, {"json": {"priority_ceiling": 1000}}),
        # issue 16 (N2): a tenant's quotas and usage; members read their own only
        "GET /api/v1/tenants/{tenant_id}/quota": (OBJECT, {}),
        "GET /api/v1/users": (GLOBAL, {}),
        "POST /api/v1/users": (BODY_REF, {"json": {
            "username": "mole", "password": "mole-pass-1", "tenant_id": a.tenant_id}}),
        "GET /api/v1/sharing-groups": (GLOBAL, {}),
        "POST /api/v1/sharing-groups": (GLOBAL, {"json": {"name": "mine"}}),
        "GET /api/v1/sharing-groups/{group_id}": (OBJECT, {}),
        "DELETE /api/v1/sharing-groups/{group_id}": (OBJECT, {}),
        "POST /api/v1/sharing-groups/{group_id}/tenants": (
            OBJECT, {"json": {"tenant_id": b.tenant_id}}),
        "DELETE /api/v1/sharing-groups/{group_id}/tenants/{tenant_id}": (OBJECT, {}),
        "GET /api/v1/task-groups": (GLOBAL, {}),
        "POST /api/v1/task-groups": (GLOBAL, {"json": service_body(name="b-own")}),
        "GET /api/v1/task-groups/{group_id}": (OBJECT, {}),
        "DELETE /api/v1/task-groups/{group_id}": (OBJECT, {}),
        # issue 13: the service's life
        "PATCH /api/v1/task-groups/{group_id}": (OBJECT, {"json": {"idle_timeout_minutes": 5}}),
        "POST /api/v1/task-groups/{group_id}/stop": (OBJECT, {}),
        "POST /api/v1/task-groups/{group_id}/start": (OBJECT, {}),
        "POST /api/v1/tasks/{task_id}/sleep": (OBJECT, {}),
        "POST /api/v1/tasks/{task_id}/wake": (OBJECT, {}),
        "POST /api/v1/task-groups/{group_id}/sleep": (OBJECT, {}),
        "POST /api/v1/task-groups/{group_id}/wake": (OBJECT, {}),
        "GET /api/v1/agent/task-life": (OBJECT, {}),
        # issue 14: fleet operations
        "PUT /api/v1/task-groups/{group_id}/scale": (OBJECT, {"json": {"replicas": 2}}),
        "PUT /api/v1/task-groups/{group_id}/scale-policy": (
            OBJECT, {"json": {"enabled": True, "metric": "inflight", "target": 4}}),
        "PUT /api/v1/task-groups/{group_id}/update": (
            OBJECT, {"json": {"image": "ghcr.io/ggml-org/llama.cpp:server-b2"}}),
        "PUT /api/v1/task-groups/{group_id}/schedule-window": (
            OBJECT, {"json": {"start": "08:00", "end": "20:00"}}),
        "GET /api/v1/task-groups/{group_id}/schedule-window": (OBJECT, {}),
        "DELETE /api/v1/task-groups/{group_id}/schedule-window": (OBJECT, {}),
        "POST /api/v1/gateway/activity": (OBJECT, {"json": {"activity": []}}),
        "POST /api/v1/gateway/wake": (OBJECT, {"json": {"group_ids": [a.group_id]}}),
        "GET /api/v1/task-groups/{group_id}/events": (OBJECT, {}),
        "GET /api/v1/tasks/{task_id}": (OBJECT, {}),
        "POST /api/v1/tasks/{task_id}/stop": (OBJECT, {}),
        "POST /api/v1/tasks/{task_id}/drain": (OBJECT, {}),
        "DELETE /api/v1/tasks/{task_id}/drain": (OBJECT, {}),
        "GET /api/v1/tasks/{task_id}/logs": (OBJECT, {}),
        "GET /api/v1/gateway/endpoints": (GLOBAL, {}),
        "PATCH /api/v1/gateway/endpoints/{endpoint_id}": (OBJECT, {"json": {"rotate_key": True}}),
        "PUT /api/v1/gateway/endpoints/{endpoint_id}": (OBJECT, {"json": {"rotate_key": True}}),
        "DELETE /api/v1/gateway/endpoints/{endpoint_id}": (OBJECT, {}),
        "GET /api/v1/model-routes": (GLOBAL, {"params": {"group_id": a.group_id}}),
        "POST /api/v1/model-routes": (BODY_REF, {"json": {
            "model_name": "stolen", "group_id": a.group_id}}),
        "PUT /api/v1/model-routes/{route_id}": (OBJECT, {"json": {"weight": 1}}),
        "DELETE /api/v1/model-routes/{route_id}": (OBJECT, {}),
        "GET /api/v1/gateway/snapshot": (OBJECT, {}),  # key hashes of every tenant
        "POST /api/v1/gateway/usage": (OBJECT, {"json": {"records": []}}),
        "GET /api/v1/usage": (BODY_REF, {"params": {"tenant_id": a.tenant_id}}),
        "GET /api/v1/nodes": (GLOBAL, {}),
        "GET /api/v1/nodes/{node_id}/inference-template": (OBJECT, {}),
        # issue 33: the live series and the fleet overview
        "GET /api/v1/task-groups/{group_id}/series": (OBJECT, {}),
        "GET /api/v1/nodes/{node_id}/series": (OBJECT, {}),
        "GET /api/v1/fleet/overview": (GLOBAL, {}),
        "POST /api/v1/agent/heartbeat": (OBJECT, {"json": {
            "name": "node-a", "address": "127.0.0.1", "inventory": {}}}),
        "POST /api/v1/agent/tasks/{task_id}/claim": (OBJECT, {"json": {}}),
        "POST /api/v1/agent/tasks/{task_id}/report": (OBJECT, {"json": {"status": "failed"}}),
        "POST /api/v1/agent/tasks/{task_id}/logs": (OBJECT, {"json": {"text": "forged"}}),
        # J2, H7: a recreate's pre-pull, asked of and answered by the node's agent
        "GET /api/v1/agent/prepulls": (OBJECT, {}),
        "POST /api/v1/agent/tasks/{task_id}/prepull": (OBJECT, {"json": {
            "image": "ghcr.io/ggml-org/llama.cpp:server-b2", "outcome": "pulled"}}),
        "POST /api/v1/file-requests": (BODY_REF, {"json": {
            "task_id": a.task_id, "request_type": "list", "target_path": "/data/models"}}),
        "GET /api/v1/file-requests/{request_id}": (OBJECT, {}),
        "GET /api/v1/file-requests/{request_id}/content": (OBJECT, {}),
        "GET /api/v1/agent/file-requests": (OBJECT, {}),
        "POST /api/v1/agent/file-requests/{request_id}/chunks": (
            OBJECT, {"content": b"x", "headers": {"X-Chunk-Seq": "0"}}),
        "POST /api/v1/agent/file-requests/{request_id}/done": (
            OBJECT, {"json": {"status": "done"}}),
        "GET /api/v1/audit": (GLOBAL, {"params": {"tenant_id": a.tenant_id}}),
        "GET /api/v1/servers": (GLOBAL, {}),  # server instances: operators only
        # issue 16 (L1): the platform switches, operators only (403 for members)
        "GET /api/v1/platform-settings": (GLOBAL, {}),
        "PUT /api/v1/platform-settings": (GLOBAL, {"json": {"inference_dedup_enabled": True}}),
        "GET /api/v1/openapi.json": (GLOBAL, {}),
        "GET /api/v1/docs": (GLOBAL, {}),
        # issue 28 (H7): registry credentials, operators and tenant admins only
        "GET /api/v1/registry-credentials": (GLOBAL, {}),
        "POST /api/v1/registry-credentials": (BODY_REF, {"json": {
            "registry_host": "r.example.com", "username": "u", "password": "pass-123",
            "tenant_id": a.tenant_id}}),
        "GET /api/v1/registry-credentials/{credential_id}": (OBJECT, {}),
        "PATCH /api/v1/registry-credentials/{credential_id}": (
            OBJECT, {"json": {"password": "stolen-pass"}}),
        "DELETE /api/v1/registry-credentials/{credential_id}": (OBJECT, {}),
        # issue 29 (H9): hub tokens, operators and tenant admins only
        "GET /api/v1/hub-tokens": (GLOBAL, {}),
        "POST /api/v1/hub-tokens": (BODY_REF, {"json": {
            "hub": "hf", "token": "hf_stolen-token", "tenant_id": a.tenant_id}}),
        "GET /api/v1/hub-tokens/{token_id}": (OBJECT, {}),
        "PATCH /api/v1/hub-tokens/{token_id}": (OBJECT, {"json": {"token": "hf_stolen-token"}}),
        "DELETE /api/v1/hub-tokens/{token_id}": (OBJECT, {}),
        # issue 28 (H8): the engines and their maturity, the same for everyone
        "GET /api/v1/engines": (GLOBAL, {}),
        # issue 28: a service's LoRA adapters, its owner's
        "GET /api/v1/task-groups/{group_id}/adapters": (OBJECT, {}),
        "POST /api/v1/task-groups/{group_id}/adapters": (
            OBJECT, {"json": {"name": "stolen-lora", "path": "/data/models/lora"}}),
        "DELETE /api/v1/task-groups/{group_id}/adapters/{name}": (OBJECT, {}),
        # issue 29 (H9): the nodes' model caches, operators only (403 for members)
        "GET /api/v1/models/cache": (GLOBAL, {}),
        "POST /api/v1/nodes/{node_id}/models/pull": (GLOBAL, {"json": {"source": "hf://o/n"}}),
        "POST /api/v1/nodes/{node_id}/models/evict": (GLOBAL, {"json": {"key": "hf--o--n--1"}}),
        "GET /api/v1/model-requests/{request_id}": (GLOBAL, {}),
        "GET /api/v1/agent/model-requests": (OBJECT, {}),
        "POST /api/v1/agent/model-requests/{request_id}": (OBJECT, {"json": {"status": "failed"}}),
    }


def hub_token(api: Api, admin: dict[str, str], tenant_id: str) -> str:
    """An operator's hub token for ``tenant_id`` (H9): its id."""
    r = api.client.post("/api/v1/hub-tokens", headers=admin,
                        json={"hub": "hf", "token": "hf_walker-token-1", "tenant_id": tenant_id})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def fill(path: str, a: World) -> str:
    """A's real id for each path parameter."""
    ids = {
        "tenant_id": a.tenant_id, "task_id": a.task_id, "endpoint_id": a.endpoint_id,
        "route_id": a.added_route_id, "request_id": a.file_request_id,
        "node_id": a.dedicated_node_id,
        "group_id": a.group_id, "credential_id": a.registry_credential_id,
        "name": "an-adapter", "token_id": a.hub_token_id,
    }
    if path.startswith("/api/v1/sharing-groups/"):
        ids["group_id"] = a.sharing_group_id
    return PARAM.sub(lambda m: ids[m.group(1)], path)


def leaks(text: str, a: World, sent: str = "") -> list[str]:
    """A's ids in an answer — except those the caller sent itself (a 404 may echo them)."""
    return [f"{kind} {value}" for kind, value in a.ids().items()
            if value in text and value not in sent]


def test_a_member_of_another_tenant_is_refused_every_operation_on_a_tenants_objects(
    api: Api,
) -> None:
    admin = api.login()
    alice = api.member(admin, "tenant-a", "alice")
    bob = api.member(admin, "tenant-b", "bob")
    node_id = api.heartbeat()
    a = build_world(api, alice, "alice", "a-svc", node_id)
    b = build_world(api, bob, "bob", "b-svc", node_id)
    # an operator puts A's tenant in a sharing group: B may not see or change it
    sg = api.client.post("/api/v1/sharing-groups", json={"name": "a-group"}, headers=admin)
    assert sg.status_code == 201, sg.text
    a.sharing_group_id = sg.json()["id"]
    r = api.client.post(f"/api/v1/sharing-groups/{a.sharing_group_id}/tenants",
                        json={"tenant_id": a.tenant_id}, headers=admin)
    assert r.status_code == 200, r.text
    # ... and sets a registry credential for A's tenant (H7): B may not see or change it
    r = api.client.post("/api/v1/registry-credentials", headers=admin, json={
        "registry_host": "a.example.com", "username": "a", "password": "a-pass-123",
        "tenant_id": a.tenant_id})
    assert r.status_code == 201, r.text
    a.registry_credential_id = r.json()["id"]
    a.hub_token_id = hub_token(api, admin, a.tenant_id)  # H9: the same for a hub token

    doc = api.client.get("/api/v1/openapi.json").json()
    known = operations(a, b)
    walked = [f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops]
    walked += ["GET /api/v1/openapi.json", "GET /api/v1/docs"]
    unknown = sorted(set(walked) - set(known))
    assert unknown == [], f"classify these new operations in the walker: {unknown}"
    # control: the ids are real: their owner (an operator for sharing groups) reads
    # them (a listing has no content to download: 409, not 404)
    for op, (kind, _) in known.items():
        method, path = op.split(" ", 1)
        if kind == OBJECT and method == "GET" and "{" in path and "/agent/" not in path:
            by_operator = ("/api/v1/sharing-groups/", "/api/v1/registry-credentials/",
                           "/api/v1/hub-tokens/")
            owner = admin if path.startswith(by_operator) else alice
            r = api.client.get(fill(path, a), headers=owner)
            assert r.status_code == (409 if path.endswith("/content") else 200), (op, r.text)
    # global operations first: later refused attempts must not be what shows up in them
    order = sorted(walked, key=lambda op: (known[op][0] != GLOBAL, op.startswith("DELETE")))
    problems: list[str] = []
    for op in order:
        kind, kw = known[op]
        method, path = op.split(" ", 1)
        url = fill(path, a)
        headers = {**bob, **kw.get("headers", {})}
        r = api.client.request(method, url, **{**kw, "headers": headers})
        sent = url + repr(kw)
        if r.status_code >= 500:
            problems.append(f"{op}: {r.status_code}")
        elif kind == GLOBAL:
            if not (200 <= r.status_code < 500) or leaks(r.text, a, sent):
                problems.append(f"{op}: {r.status_code} leaks {leaks(r.text, a, sent)}")
        else:
            machine = ("/api/v1/agent/", "/api/v1/gateway/s", "/api/v1/gateway/u",
                       "/api/v1/gateway/activity", "/api/v1/gateway/wake")
            allowed = TOKEN_REFUSED if path.startswith(machine) else REFUSED[kind]
            if r.status_code not in allowed or leaks(r.text, a, sent):
                problems.append(f"{op}: {r.status_code} {r.text[:160]}")
    assert problems == []
    # and nothing of A's changed: its task still runs, its key and routes still stand
    task = api.client.get(f"/api/v1/tasks/{a.task_id}", headers=alice).json()
    assert (task["status"], task["draining"]) == ("running", False)
    routes = api.client.get("/api/v1/model-routes", headers=alice).json()
    assert {r["id"] for r in routes} == {a.route_id, a.added_route_id}
    assert [r["weight"] for r in routes] == [100, 100]
    endpoints = api.client.get("/api/v1/gateway/endpoints", headers=alice).json()
    assert [e["key_prefix"] for e in endpoints] == [a.key_prefix]
