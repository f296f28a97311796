"""Inference dedup and cross-tenant reuse through the real API (L1-L4, issue 16).

Every branch on SQLite and PostgreSQL: the switches (operators only, off by default),
dedup off, a running service reused, a sleeping one woken, a wake that must wait (node
offline, card borrowed), cross-tenant reuse in and out of a sharing group, a sharing
lookup that fails (refused: fail-closed), the dry run answering what the create does, and
the operator's cross-tenant route obeying the same sharing-group rule.

The agent protocol is driven by hand (claim, report) as in test_sleep_wake.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from heteroflow.schemas.routing import RoutingSnapshot, hash_key
from heteroflow.services.placement import dedup
from heteroflow.services.serving.routing import build_snapshot
from heteroflow.services.tenancy import sharing

from .conftest import Api, service_body

A10 = {"index": 0, "vendor": "nvidia", "model": "A10", "memory_total_mb": 24576}
SETTINGS = "/api/v1/platform-settings"
GROUPS = "/api/v1/task-groups"


# -- helpers ---------------------------------------------------------------------------


def switches(api: Api, admin: dict[str, str], **values: bool) -> dict[str, Any]:
    r = api.client.put(SETTINGS, json=values, headers=admin)
    assert r.status_code == 200, r.text
    return dict(r.json())


def create(api: Api, who: dict[str, str], **over: Any) -> dict[str, Any]:
    r = api.client.post(GROUPS, json=service_body(**over), headers=who)
    assert r.status_code == 201, r.text
    return dict(r.json())


def dry_run(api: Api, who: dict[str, str], **over: Any) -> dict[str, Any]:
    r = api.client.post(f"{GROUPS}?dry_run=true", json=service_body(**over), headers=who)
    assert r.status_code == 200, r.text
    return dict(r.json())


def agent(api: Api, node_id: str, task_id: str, what: str, **body: Any) -> None:
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/{what}", body)
    assert r.status_code == 200, r.text


def running(api: Api, who: dict[str, str], node: str = "node-a", **over: Any) -> dict[str, Any]:
    """A service whose one task runs on ``node`` (placed by the real scheduler)."""
    node_id = api.heartbeat(node, gpus=over.pop("gpus", None))
    g = create(api, who, **over)
    api.app.scheduler.run_round()
    task_id = g["tasks"][0]["id"]
    agent(api, node_id, task_id, "claim")
    agent(api, node_id, task_id, "report", status="running")
    return {**g, "node_id": node_id, "task_id": task_id}


def sleep(api: Api, who: dict[str, str], task_id: str) -> None:
    r = api.client.post(f"/api/v1/tasks/{task_id}/sleep", headers=who)
    assert r.status_code == 202 and r.json()["status"] == "sleeping", r.text


def task(api: Api, who: dict[str, str], task_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/tasks/{task_id}", headers=who)
    assert r.status_code == 200, r.text
    return dict(r.json())


def group_ids(api: Api, admin: dict[str, str]) -> list[str]:
    return [g["id"] for g in api.client.get(GROUPS, headers=admin).json()]


def routes(api: Api, who: dict[str, str]) -> list[dict[str, Any]]:
    return list(api.client.get("/api/v1/model-routes", headers=who).json())


def snapshot(api: Api) -> RoutingSnapshot:
    with api.app.db.session() as s:
        return build_snapshot(s, 1)


def answers(api: Api, key: str, model: str) -> list[str]:
    """The groups of backends the gateway would send ``model`` to for ``key`` (by the
    snapshot it builds): callable at once when not empty."""
    snap = snapshot(api)
    entry = snap.keys[hash_key(key)]
    if model not in entry.models:
        return []
    targets = snap.routes.get((entry.tenant_id, model), ())
    return sorted({b.group_id for t in targets for b in t.backends})


def share(api: Api, admin: dict[str, str], *tenants: str) -> str:
    sg = api.client.post("/api/v1/sharing-groups", json={"name": "pool"}, headers=admin)
    assert sg.status_code == 201, sg.text
    for t in tenants:
        r = api.client.post(f"/api/v1/sharing-groups/{sg.json()['id']}/tenants",
                            json={"tenant_id": t}, headers=admin)
        assert r.status_code == 200, r.text
    return str(sg.json()["id"])


def tenant_of(api: Api, who: dict[str, str]) -> str:
    mine = api.client.get("/api/v1/tenants", headers=who).json()  # a member sees its own
    assert len(mine) == 1, mine
    return str(mine[0]["id"])


# -- L1: the switches ------------------------------------------------------------------


@pytest.mark.feature("L1")
def test_the_switches_are_off_by_default_and_only_operators_set_them(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "acme", "ann")
    off = {"inference_dedup_enabled": False, "cross_tenant_dedup_enabled": False}
    assert api.client.get(SETTINGS, headers=admin).json() == off
    assert api.client.get(SETTINGS, headers=member).status_code == 403
    r = api.client.put(SETTINGS, json={"inference_dedup_enabled": True}, headers=member)
    assert r.status_code == 403
    assert api.client.get(SETTINGS, headers=admin).json() == off  # unchanged
    # unknown keys and non-booleans: 400 naming the field
    r = api.client.put(SETTINGS, json={"inference_dedup": True}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "inference_dedup", r.text
    r = api.client.put(SETTINGS, json={"jwt_secret": "x"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "jwt_secret"
    r = api.client.put(SETTINGS, json={"cross_tenant_dedup_enabled": "yes"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "cross_tenant_dedup_enabled"
    # one at a time; a field left out keeps its value; the answer never shows other rows
    on = switches(api, admin, inference_dedup_enabled=True)
    assert on == {"inference_dedup_enabled": True, "cross_tenant_dedup_enabled": False}
    both = switches(api, admin, cross_tenant_dedup_enabled=True)
    assert both == {"inference_dedup_enabled": True, "cross_tenant_dedup_enabled": True}
    assert switches(api, admin) == both
    assert switches(api, admin, inference_dedup_enabled=False)["inference_dedup_enabled"] is False
    assert api.client.get(SETTINGS, headers=admin).json() == {
        "inference_dedup_enabled": False, "cross_tenant_dedup_enabled": True}


# -- L2, L3: same tenant -------------------------------------------------------------


@pytest.mark.feature("L1", "L2")
def test_with_dedup_off_the_same_model_starts_a_second_service(api: Api) -> None:
    admin = api.login()
    first = running(api, admin, name="one")
    second = create(api, admin, name="two")
    assert second["id"] != first["id"] and second["dedup"] is None
    assert dry_run(api, admin, name="three")["dedup"] is None
    assert len(group_ids(api, admin)) == 2


@pytest.mark.feature("L2", "L3")
def test_a_running_service_is_reused_and_its_new_key_answers_at_once(api: Api) -> None:
    admin = api.login()
    first = running(api, admin, name="llm", model_name="llm")
    switches(api, admin, inference_dedup_enabled=True)
    before = {r["id"] for r in routes(api, admin)}

    plan = dry_run(api, admin, name="llm-2", model_name="llm")
    assert plan["tasks"] == []  # nothing would be placed
    assert plan["dedup"]["group_id"] == first["id"]
    assert (plan["dedup"]["action"], plan["dedup"]["level"]) == ("reused", "success")
    assert group_ids(api, admin) == [first["id"]]  # a dry run writes nothing

    r = create(api, admin, name="llm-2", model_name="llm")
    d = r["dedup"]
    assert r["id"] == first["id"] and d["group_id"] == first["id"] and d["reused"] is True
    assert (d["action"], d["level"], d["cross_tenant"]) == ("reused", "success", False)
    assert d["message"] == plan["dedup"]["message"]  # the dry run said what happens
    assert "no new engine starts" in d["message"] and "tiny.gguf" in d["message"]
    assert group_ids(api, admin) == [first["id"]]  # no new group, no new task
    assert [t["id"] for t in r["tasks"]] == [first["task_id"]]
    # same tenant, same model name: the route it had is kept (dedup by model name)
    assert d["route_added"] is False and {x["id"] for x in routes(api, admin)} == before
    # its own endpoint and key, callable at once; the first key still answers
    assert r["api_key"] and r["api_key"] != first["api_key"]
    assert r["endpoint"] == d["endpoint_id"] != first["endpoint"]
    assert answers(api, r["api_key"], "llm") == [first["id"]]
    assert answers(api, first["api_key"], "llm") == [first["id"]]

    # another model name for the same model: a route of its own to the same group
    other = create(api, admin, name="alias", model_name="llm-alias")
    assert other["id"] == first["id"] and other["dedup"]["route_added"] is True
    added = [x for x in routes(api, admin) if x["model_name"] == "llm-alias"]
    assert [(x["group_id"], x["added"]) for x in added] == [(first["id"], True)]
    assert answers(api, other["api_key"], "llm-alias") == [first["id"]]
    events = api.client.get(f"{GROUPS}/{first['id']}/events", headers=admin).json()
    assert [e["to_status"] for e in events if e["kind"] == "group.dedup_reused"] == [
        "reused", "reused"]

    # a different image or model path is another service
    img = create(api, admin, name="img", task={"image": "ghcr.io/ggml-org/llama.cpp:full"})
    path = create(api, admin, name="path", task={"model_path": "other.gguf"})
    assert img["dedup"] is None and path["dedup"] is None
    assert len({img["id"], path["id"], first["id"]}) == 3


@pytest.mark.feature("L2")
def test_a_sleeping_service_is_woken_by_a_create_that_reuses_it(api: Api) -> None:
    admin = api.login()
    first = running(api, admin, name="llm")
    sleep(api, admin, first["task_id"])
    switches(api, admin, inference_dedup_enabled=True)
    plan = dry_run(api, admin, name="again")
    assert (plan["dedup"]["action"], plan["dedup"]["level"]) == ("woken", "info")
    assert task(api, admin, first["task_id"])["status"] == "sleeping"  # not by a dry run

    r = create(api, admin, name="again")
    d = r["dedup"]
    assert r["id"] == first["id"] and (d["action"], d["level"]) == ("woken", "info")
    assert d["message"] == plan["dedup"]["message"]
    assert [(w["task_id"], w["branch"]) for w in d["wake"]] == [(first["task_id"], "waking")]
    assert d["group_status"] == "waking" and r["status"] == "waking"
    assert task(api, admin, first["task_id"])["status"] == "waking"
    assert group_ids(api, admin) == [first["id"]]
    # once healthy again, the new key reaches it
    agent(api, first["node_id"], first["task_id"], "report", status="running")
    assert answers(api, r["api_key"], "again") == [first["id"]]


@pytest.mark.feature("L2")
def test_a_sleeping_service_on_an_offline_node_records_wake_requested(api: Api) -> None:
    admin = api.login()
    first = running(api, admin, name="llm")
    sleep(api, admin, first["task_id"])
    switches(api, admin, inference_dedup_enabled=True)
    api.clock.advance(api.app.settings.node_offline_after_s + 1)  # no heartbeat since
    plan = dry_run(api, admin, name="again")
    assert (plan["dedup"]["action"], plan["dedup"]["level"]) == ("wake_requested", "warning")

    r = create(api, admin, name="again")
    d = r["dedup"]
    assert r["id"] == first["id"]
    assert (d["action"], d["level"]) == ("wake_requested", "warning")
    assert "is offline" in d["message"] and d["message"] == plan["dedup"]["message"]
    assert [(w["branch"], w["wake_requested"]) for w in d["wake"]] == [("node_offline", True)]
    t = task(api, admin, first["task_id"])
    assert (t["status"], t["wake_requested"]) == ("sleeping", True)
    assert group_ids(api, admin) == [first["id"]]  # still no second service
    # the node is back: the wake retrier wakes it (the recorded wake is not lost)
    api.heartbeat("node-a")
    api.app.leadership.reconcile_once(api.clock.now())
    assert api.app.wakes.run_round().woken == [first["task_id"]]


@pytest.mark.feature("L2")
def test_a_sleeping_service_whose_card_is_borrowed_records_wake_requested(api: Api) -> None:
    admin = api.login()
    first = running(api, admin, name="llm", node="gpu-node", gpus=[A10],
                    task={"gpu_required": 1})
    sleep(api, admin, first["task_id"])
    train = {"name": "train", "task_type": "training", "task": {
        "image": "trainer:latest", "command": ["python", "train.py"], "gpu_required": 1}}
    t = api.client.post(GROUPS, json=train, headers=admin).json()["tasks"][0]["id"]
    api.app.scheduler.run_round()
    agent(api, first["node_id"], t, "claim")
    agent(api, first["node_id"], t, "report", status="running")
    switches(api, admin, inference_dedup_enabled=True)

    r = create(api, admin, name="again", task={"gpu_required": 1})
    d = r["dedup"]
    assert r["id"] == first["id"] and (d["action"], d["level"]) == ("wake_requested", "warning")
    assert "borrowed" in d["message"] and t in d["message"]
    assert [w["branch"] for w in d["wake"]] == ["card_borrowed"]
    assert task(api, admin, first["task_id"])["wake_requested"] is True


# -- L4: across tenants --------------------------------------------------------------


@pytest.mark.feature("L3", "L4")
def test_another_tenant_reuses_a_service_only_inside_one_sharing_group(api: Api) -> None:
    admin = api.login()
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    t1, t2 = tenant_of(api, one), tenant_of(api, two)
    first = running(api, one, name="llm", model_name="llm")

    def attempt(name: str) -> dict[str, Any]:
        return create(api, two, name=name, model_name="shared-llm")

    # dedup on, cross-tenant off: tenant two gets its own service
    switches(api, admin, inference_dedup_enabled=True)
    own = attempt("a")
    assert own["id"] != first["id"] and own["dedup"] is None
    assert api.client.delete(f"{GROUPS}/{own['id']}", headers=two).status_code == 204
    # cross-tenant on, but the tenants share no sharing group: still its own
    switches(api, admin, cross_tenant_dedup_enabled=True)
    own = attempt("b")
    assert own["id"] != first["id"] and own["dedup"] is None
    assert api.client.delete(f"{GROUPS}/{own['id']}", headers=two).status_code == 204
    # an operator puts both in one sharing group: reused
    share(api, admin, t1, t2)
    plan = dry_run(api, two, name="c", model_name="shared-llm")
    assert plan["dedup"]["cross_tenant"] is True
    r = attempt("c")
    d = r["dedup"]
    assert d["cross_tenant"] is True and d["action"] == "reused"
    assert d["message"] == plan["dedup"]["message"]
    # issue 26: answered in its own names, nothing of the owner's (test_dedup_disclosure)
    assert (r["id"], d["group_id"], plan["dedup"]["group_id"]) == ("", "", "")
    assert r["tenant_id"] == t2 and r["tasks"] == [] and "of tenant one" not in d["message"]
    # its own (tenant, model name) route to the same group, which it may delete
    mine = routes(api, two)
    assert [(x["tenant_id"], x["model_name"], x["group_id"], x["added"]) for x in mine] == [
        (t2, "shared-llm", "", True)]
    assert [x["group_id"] for x in routes(api, admin) if x["id"] == mine[0]["id"]] == [
        first["id"]]  # the operator sees which service it is
    assert not [x for x in routes(api, one) if x["model_name"] == "shared-llm"]
    # both keys answer, each by its own name; the group stays the owner's alone
    assert answers(api, r["api_key"], "shared-llm") == [first["id"]]
    assert answers(api, r["api_key"], "llm") == []  # the owner's name is not two's
    assert answers(api, first["api_key"], "llm") == [first["id"]]
    assert api.client.get(f"{GROUPS}/{first['id']}", headers=two).status_code == 404
    endpoints = api.client.get("/api/v1/gateway/endpoints", headers=two).json()
    assert [(e["id"], e["tenant_id"]) for e in endpoints] == [(r["endpoint"], t2)]
    # the owner's group ids: still one service for the model
    assert [g for g in group_ids(api, admin)] == [first["id"]]


@pytest.mark.feature("L4")
def test_a_failing_sharing_lookup_refuses_cross_tenant_reuse(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = api.login()
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    t1, t2 = tenant_of(api, one), tenant_of(api, two)
    first = running(api, one, name="llm")
    switches(api, admin, inference_dedup_enabled=True, cross_tenant_dedup_enabled=True)
    share(api, admin, t1, t2)

    def broken(*_: Any) -> frozenset[str]:
        raise OperationalError("SELECT sharing_group_id", {}, Exception("connection lost"))

    monkeypatch.setattr(sharing, "_read_peers", broken)
    plan = dry_run(api, two, name="x")
    assert plan["dedup"] is None and dedup.LOOKUP_FAILED in plan["warnings"]
    r = create(api, two, name="x")
    assert r["id"] != first["id"] and r["dedup"] is None  # fail-closed: its own service
    assert dedup.LOOKUP_FAILED in r["warnings"]
    # the transaction went on: the create is stored
    assert r["id"] in group_ids(api, admin)
    # its own tenant's services are still reused
    api.app.scheduler.run_round()
    agent(api, first["node_id"], r["tasks"][0]["id"], "claim")
    agent(api, first["node_id"], r["tasks"][0]["id"], "report", status="running")
    again = create(api, two, name="y")
    assert again["id"] == r["id"] and again["dedup"]["cross_tenant"] is False
    # the operator's cross-tenant route is refused the same way
    body = {"model_name": "m", "group_id": first["id"], "tenant_id": t2}
    refused = api.client.post("/api/v1/model-routes", json=body, headers=admin)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["field"] == "tenant_id"
    assert "fail-closed" in refused.json()["error"]["message"]


@pytest.mark.feature("L4")
def test_an_operator_routes_a_tenant_to_another_tenants_service_only_when_they_share(
    api: Api,
) -> None:
    admin = api.login()
    one = api.member(admin, "one", "u1")
    two = api.member(admin, "two", "u2")
    t1, t2 = tenant_of(api, one), tenant_of(api, two)
    first = create(api, one, name="llm")
    body = {"model_name": "platform-llm", "group_id": first["id"], "tenant_id": t2}
    r = api.client.post("/api/v1/model-routes", json=body, headers=admin)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["field"] == "tenant_id" and "share no sharing group" in err["message"]
    assert t1 in err["message"] and t2 in err["message"]
    # the owner's own tenant needs no sharing group
    same = {"model_name": "alias", "group_id": first["id"], "tenant_id": t1}
    assert api.client.post("/api/v1/model-routes", json=same, headers=admin).status_code == 201
    share(api, admin, t1, t2)
    r = api.client.post("/api/v1/model-routes", json=body, headers=admin)
    assert r.status_code == 201, r.text
    assert (r.json()["tenant_id"], r.json()["group_id"]) == (t2, first["id"])
