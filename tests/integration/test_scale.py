"""Scaling by hand (I2) and the replica fields at create (A1), on a real database with a
fake clock; the agent protocol is driven by hand (claim, report) and the gateways' load
reports are posted as a gateway would (``POST /api/v1/gateway/activity``).

Proven: scale out adds pending tasks of the new ranks with the current task intent, in
the group's tenant; scale in takes the highest ranks first (never rank 0), drains a
running one and stops it once every gateway reports it drained (or past the drain
timeout), stops one that is not serving at once, and the count, the tasks and the
events agree; bounds are 400 naming the field, a stopped service 409, another tenant's
404; the policy route sets the bounds and moves the count into them."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.core.errors import Conflict
from heteroflow.db.tables import Task, TaskGroup
from heteroflow.services.lifecycle.scaling import SCALED_IN, scale_as_platform
from heteroflow.services.tenancy.usage import read_load

from .conftest import Api, service_body

GATEWAY = {"Authorization": "Bearer gw-token-for-tests"}


# ---- helpers ------------------------------------------------------------------------


def create(api: Api, headers: dict[str, str], **over: Any) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


def group(api: Api, headers: dict[str, str], group_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def task(api: Api, headers: dict[str, str], task_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/tasks/{task_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def events(api: Api, headers: dict[str, str], group_id: str, kind: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}/events", headers=headers)
    return [e for e in r.json() if e["kind"] == kind]


def scale(api: Api, headers: dict[str, str], group_id: str, n: Any) -> Any:
    return api.client.put(
        f"/api/v1/task-groups/{group_id}/scale", json={"replicas": n}, headers=headers
    )


def policy(api: Api, headers: dict[str, str], group_id: str, **body: Any) -> Any:
    return api.client.put(
        f"/api/v1/task-groups/{group_id}/scale-policy", json=body, headers=headers
    )


def run_all(api: Api, node_id: str, headers: dict[str, str], group_id: str) -> None:
    """Place the group's pending tasks and start every placed one, as its agent would."""
    api.app.scheduler.run_round()
    for t in group(api, headers, group_id)["tasks"]:
        if t["status"] == "scheduled":
            tid = t["id"]
            claim = api.agent_post(node_id, f"/api/v1/agent/tasks/{tid}/claim", {})
            assert claim.status_code == 200, claim.text
            r = api.agent_post(node_id, f"/api/v1/agent/tasks/{tid}/report", {"status": "running"})
            assert r.status_code == 200, r.text


def report_load(api: Api, backends: list[dict[str, Any]], gateway_id: str = "gw-a") -> None:
    body = {"activity": [], "load": {"gateway_id": gateway_id, "backends": backends}}
    r = api.client.post("/api/v1/gateway/activity", json=body, headers=GATEWAY)
    assert r.status_code == 200, r.text


def backend(task_id: str, group_id: str, in_flight: int = 0, draining: bool = False,
            **more: Any) -> dict[str, Any]:
    return {"task_id": task_id, "group_id": group_id, "in_flight": in_flight,
            "draining": draining, **more}


def drain_round(api: Api) -> list[str]:
    api.app.leadership.reconcile_once(api.clock.now())
    return api.app.scale_drainer.run_round()


# ---- scale out, scale in ---------------------------------------------------------------


@pytest.mark.feature("I2", "A1", "A8")
def test_scale_out_copies_the_intent_and_scale_in_drains_the_highest_ranks_first(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = create(
        api, admin, max_replicas=3,
        task={"engine_args": ["-c", "512"], "env": ["GGML_FLAG=1"]},
    )
    gid = g["id"]
    assert (g["min_replicas"], g["current_replicas"], g["max_replicas"]) == (1, 1, 3)
    run_all(api, node, admin, gid)
    first = task(api, admin, g["tasks"][0]["id"])

    r = scale(api, admin, gid, 3)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["current_replicas"], out["world_size"]) == (3, 3)
    ranks = {t["rank"]: t for t in out["tasks"]}
    assert sorted(ranks) == [0, 1, 2] and ranks[0]["id"] == first["id"]
    for rank in (1, 2):
        new = ranks[rank]
        assert new["status"] == "pending" and new["node_id"] is None
        assert new["name"] == f"svc-{rank}" and new["generation"] == 1
        for key in ("image", "engine", "model_path", "gpu_required", "memory_mb"):
            assert new[key] == first[key], key
        assert new["ports"] == [{"container_port": 8000, "host_port": 0}]  # from the pool
    with api.app.db.session() as s:
        rows = s.scalars(select(Task).where(Task.group_id == gid)).all()
        assert {t.tenant_id for t in rows} == {g["tenant_id"]}
        assert all(t.engine_args == ["-c", "512"] and t.env == ["GGML_FLAG=1"] for t in rows)
    [scaled] = events(api, admin, gid, "group.scaled")
    assert (scaled["from_status"], scaled["to_status"]) == ("1", "3")
    assert "scaled from 1 to 3 replica(s) by admin" in scaled["message"]
    assert ranks[1]["id"] in scaled["message"] and ranks[2]["id"] in scaled["message"]

    run_all(api, node, admin, gid)
    assert group(api, admin, gid)["status"] == "running"

    # scale in: ranks 2 and 1 leave (draining), rank 0 stays; the count moves at once
    r = scale(api, admin, gid, 1)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["current_replicas"] == 1 and [t["id"] for t in out["tasks"]] == [first["id"]]
    assert out["status"] == "running"
    for rank in (1, 2):
        left = task(api, admin, ranks[rank]["id"])
        assert (left["status"], left["draining"], left["replaced_by"]) == (
            "running", True, SCALED_IN,
        )
    snap = api.app.publisher.refresh()
    drains = {b.task_id: b.draining for ts in snap.routes.values() for t in ts for b in t.backends}
    assert drains == {first["id"]: False, ranks[1]["id"]: True, ranks[2]["id"]: True}
    last = events(api, admin, gid, "group.scaled")[-1]
    assert (last["from_status"], last["to_status"]) == ("3", "1")
    assert "draining" in last["message"]

    # a gateway still routing old requests to them: they keep running
    t1, t2 = ranks[1]["id"], ranks[2]["id"]
    report_load(api, [backend(first["id"], gid, 2), backend(t1, gid, 0, draining=False),
                      backend(t2, gid, 1, draining=True)])
    assert drain_round(api) == []
    # rank 1: this gateway now knows it drains and nothing is in flight -> it stops
    report_load(api, [backend(t1, gid, 0, draining=True), backend(t2, gid, 1, draining=True)])
    assert drain_round(api) == [t1]
    stopping = task(api, admin, t1)
    assert stopping["status"] == "stopping"
    assert "drained" in stopping["status_message"]
    # rank 2 still has a request in flight: it waits for it, at most the drain timeout
    api.app.scale_drainer.drain_timeout_s = 30
    api.clock.advance(29)
    report_load(api, [backend(t2, gid, 1, draining=True)])
    assert drain_round(api) == []
    api.clock.advance(2)
    report_load(api, [backend(t2, gid, 1, draining=True)])
    assert drain_round(api) == [t2]
    assert "drain timeout of 30 s" in task(api, admin, t2)["status_message"]
    assert drain_round(api) == []  # level-triggered: once
    # the agent confirms the stops; the group was never anything but running
    for tid in (t1, t2):
        r = api.agent_post(node, f"/api/v1/agent/tasks/{tid}/report", {"status": "stopped"})
        assert r.status_code == 200, r.text
    g = group(api, admin, gid)
    assert g["status"] == "running" and len(g["tasks"]) == 1
    assert all(
        e["to_status"] != "stopping" for e in events(api, admin, gid, "group_status")
    )


@pytest.mark.feature("I2")
def test_without_any_gateway_report_a_leaving_replica_stops_at_once_and_a_pending_one_now(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, max_replicas=3)["id"]
    run_all(api, node, admin, gid)
    tasks = scale(api, admin, gid, 2).json()["tasks"]
    run_all(api, node, admin, gid)
    rank1 = tasks[1]["id"]
    # rank 2 is added and taken away before the scheduler saw it: stopped at once
    rank2 = next(t["id"] for t in scale(api, admin, gid, 3).json()["tasks"] if t["rank"] == 2)
    assert scale(api, admin, gid, 1).status_code == 200
    assert task(api, admin, rank2)["status"] == "stopped"
    assert task(api, admin, rank1)["status"] == "running"
    # no gateway reports its load: none can have a request in flight on it
    assert drain_round(api) == [rank1]
    with api.app.db.session() as s:
        assert read_load(s, api.clock.now(), 20).gateways == 0


@pytest.mark.feature("I2")
def test_a_leaving_replica_is_never_rebuilt_and_a_start_brings_back_only_the_current_count(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, max_replicas=2)["id"]
    run_all(api, node, admin, gid)
    leaving = scale(api, admin, gid, 2).json()["tasks"][1]["id"]
    run_all(api, node, admin, gid)
    assert scale(api, admin, gid, 1).status_code == 200
    # its engine dies while it drains: the recovery loop leaves it alone
    r = api.agent_post(node, f"/api/v1/agent/tasks/{leaving}/report",
                       {"status": "failed", "message": "engine exited", "fault": "engine_exited"})
    assert r.status_code == 200, r.text
    api.app.leadership.reconcile_once(api.clock.now())
    assert api.app.recovery.run_round().rebuilt == []
    assert group(api, admin, gid)["status"] == "running"
    # stop and start: one replica comes back, not two
    assert api.client.post(f"/api/v1/task-groups/{gid}/stop", headers=admin).status_code == 200
    assert scale(api, admin, gid, 2).status_code == 409  # stopped: start it first
    r = api.client.post(f"/api/v1/task-groups/{gid}/start", headers=admin)
    assert r.status_code == 200, r.text
    assert [t["rank"] for t in r.json()["tasks"]] == [0]


# ---- the rules -----------------------------------------------------------------------------


@pytest.mark.feature("I2", "A1")
def test_bounds_are_400_naming_the_field_stopped_is_409_other_tenants_404(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, max_replicas=3)["id"]
    run_all(api, node, admin, gid)
    for n in (4, 0, 65, "2", 1.5):
        r = scale(api, admin, gid, n)
        assert r.status_code == 400, (n, r.text)
        assert r.json()["error"]["field"] == "replicas"
    assert "outside [1, 3]" in scale(api, admin, gid, 4).json()["error"]["message"]
    # the same count: nothing changes, nothing is written
    assert scale(api, admin, gid, 1).status_code == 200
    assert events(api, admin, gid, "group.scaled") == []
    bob = api.member(admin, "team-b", "bob")
    assert scale(api, bob, gid, 2).status_code == 404
    assert policy(api, bob, gid, enabled=False).status_code == 404
    assert scale(api, admin, "tg-nosuchgroup", 2).status_code == 404
    assert api.client.post(f"/api/v1/task-groups/{gid}/stop", headers=admin).status_code == 200
    r = scale(api, admin, gid, 2)
    assert r.status_code == 409 and "stopped" in r.json()["error"]["message"]
    assert api.client.delete(f"/api/v1/task-groups/{gid}", headers=admin).status_code == 204
    assert scale(api, admin, gid, 2).status_code == 404  # deleted: not found, as everywhere

    # training groups keep their tasks
    train = create(api, admin, name="train", task_type="training")
    r = scale(api, admin, train["id"], 1)
    assert r.status_code == 400 and r.json()["error"]["field"] == "replicas"
    assert "only inference services scale" in r.text


@pytest.mark.feature("A1")
def test_create_validates_the_replica_fields_naming_each(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"min_replicas": 2}, "min_replicas", "above the group's 1"),
        ({"min_replicas": 2, "max_replicas": 1}, "min_replicas", ""),
        ({"max_replicas": 0}, "max_replicas", ""),
        ({"max_replicas": 65}, "max_replicas", ""),
        ({"task_type": "training", "max_replicas": 3}, "max_replicas", "only inference"),
        ({"parallelism": "split", "world_size": 3, "max_replicas": 2}, "max_replicas",
         "below the group's 3"),
        ({"scale_policy": {"metric": "inflight"}}, "scale_policy", "a metric and a target"),
        ({"scale_policy": {"metric": "kv_cache", "target": 101}}, "scale_policy.target", "1-100"),
        ({"scale_policy": {"metric": "queue", "target": 1, "max_replicas": 2},
          "max_replicas": 3}, "scale_policy", "differs"),
        ({"scale_policy": {"metric": "cpu", "target": 1}}, "scale_policy.metric", ""),
        ({"scale_policy": {"metric": "queue", "target": 1, "surprise": 1}},
         "scale_policy.surprise", ""),
    ]
    for over, field, text in cases:
        r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=admin)
        assert r.status_code == 400, (over, r.text)
        err = r.json()["error"]
        assert err["field"] == field, (over, err)
        assert text in err["message"], (over, err)

    split = create(api, admin, name="split", parallelism="split", world_size=2,
                   min_replicas=1, max_replicas=4,
                   scale_policy={"metric": "tokens_per_s", "target": 50})
    assert (split["min_replicas"], split["current_replicas"], split["max_replicas"]) == (1, 2, 4)
    assert split["scale_policy"] == {"enabled": True, "metric": "tokens_per_s", "target": 50.0}
    # the policy's bounds are the group's when the top level leaves them out
    via = create(api, admin, name="via",
                 scale_policy={"enabled": False, "metric": "queue", "target": 2,
                               "max_replicas": 5})
    assert (via["max_replicas"], via["scale_policy"]["enabled"]) == (5, False)
    plain = create(api, admin, name="plain")
    assert (plain["min_replicas"], plain["max_replicas"], plain["scale_policy"]) == (1, 1, {})


@pytest.mark.feature("I1", "I2", "A8")
def test_the_policy_route_sets_bounds_and_moves_the_count_into_them(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    alice = api.member(admin, "team-a", "alice")
    gid = create(api, alice)["id"]  # a member's service: they scale it themselves
    run_all(api, node, alice, gid)
    r = policy(api, alice, gid, metric="inflight", target=4, min_replicas=1, max_replicas=3)
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["scale_policy"] == {"enabled": True, "metric": "inflight", "target": 4.0}
    assert (g["min_replicas"], g["max_replicas"], g["current_replicas"]) == (1, 3, 1)
    changed = events(api, alice, gid, "group.config_changed")[-1]
    assert "scale policy changed by alice" in changed["message"]
    assert "replicas 1-3" in changed["message"]

    r = scale(api, alice, gid, 3)
    assert r.status_code == 200 and len(r.json()["tasks"]) == 3  # hers: she sees them
    # new bounds the count is outside of: it moves to the nearest one at once
    r = policy(api, alice, gid, max_replicas=2)
    assert r.status_code == 200, r.text
    assert (r.json()["current_replicas"], len(r.json()["tasks"])) == (2, 2)
    assert events(api, alice, gid, "group.scaled")[-1]["to_status"] == "2"
    # off, keeping the rest; errors name the field
    r = policy(api, alice, gid, enabled=False)
    assert r.json()["scale_policy"] == {"enabled": False, "metric": "inflight", "target": 4.0}
    for body, field in (
        ({"metric": "kv_cache"}, "target"),  # the stored target 4 is fine; 400 only > 100
        ({"metric": "kv_cache", "target": 150}, "target"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"min_replicas": 3}, "min_replicas"),
        ({"max_replicas": 65}, "max_replicas"),
    ):
        r = policy(api, alice, gid, **body)
        if body == {"metric": "kv_cache"}:
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["field"] == field, (body, r.text)
    fresh = create(api, alice, name="fresh")
    r = policy(api, alice, fresh["id"], enabled=True)
    assert r.status_code == 400 and r.json()["error"]["field"] == "metric"
    r = policy(api, alice, fresh["id"], metric="queue")
    assert r.status_code == 400 and r.json()["error"]["field"] == "target"
    # stopped: bounds that would move the count wait; others do not
    assert api.client.post(f"/api/v1/task-groups/{gid}/stop", headers=alice).status_code == 200
    assert policy(api, alice, gid, max_replicas=1).status_code == 409
    assert policy(api, alice, gid, max_replicas=4).status_code == 200


@pytest.mark.feature("I2")
def test_the_platform_scaler_a_window_uses_keeps_to_the_bounds(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, max_replicas=3)["id"]
    run_all(api, node, admin, gid)
    with api.app.db.session() as s:
        out = scale_as_platform(s, api.clock, gid, 3, "outside its schedule window")
        assert (out.before, out.after, len(out.added)) == (1, 3, 2)
    with api.app.db.session() as s:
        with pytest.raises(Conflict):
            scale_as_platform(s, api.clock, gid, 4, "too many")
        assert scale_as_platform(s, api.clock, gid, 3, "again").added == []
        g = s.get(TaskGroup, gid)
        assert g is not None and g.current_replicas == 3
    last = events(api, admin, gid, "group.scaled")[-1]
    assert "by the platform (outside its schedule window)" in last["message"]


@pytest.mark.feature("I1")
def test_load_reports_need_the_gateway_token_and_go_stale(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    gid = create(api, admin)["id"]
    body = {"load": {"gateway_id": "gw-x", "backends": [backend("task-1", gid, 3)]}}
    assert api.client.post("/api/v1/gateway/activity", json=body).status_code == 401
    alice = api.member(admin, "team-a", "alice")  # only a gateway (or an operator)
    assert api.client.post("/api/v1/gateway/activity", json=body, headers=alice).status_code in (
        401, 403,
    )
    bad = {"load": {"gateway_id": "gw-x", "backends": [backend("task-1", gid, -1)]}}
    assert api.client.post("/api/v1/gateway/activity", json=bad, headers=GATEWAY).status_code == 400
    report_load(api, [backend("task-1", gid, 3, tokens_per_s=12.5, waiting=2, kv_use=0.25)])
    report_load(api, [backend("task-1", gid, 1)], gateway_id="gw-y")
    report_load(api, [backend("task-1", gid, 2)], gateway_id="gw-y")  # replaces its last
    with api.app.db.session() as s:
        view = read_load(s, api.clock.now(), 20)
    assert (view.gateways, view.in_flight("task-1"), view.tokens_per_s("task-1")) == (2, 5, 12.5)
    assert (view.waiting("task-1"), view.kv_use("task-1")) == (2.0, 0.25)
    api.clock.advance(21)
    with api.app.db.session() as s:
        assert read_load(s, api.clock.now(), 20).gateways == 0
    # the rows of gateways long gone (ten staleness windows) are deleted by the leader
    drain_round(api)
    with api.app.db.session() as s:
        assert read_load(s, api.clock.now(), 1e9).gateways == 2
    api.clock.advance(200)
    drain_round(api)
    with api.app.db.session() as s:
        assert read_load(s, api.clock.now(), 1e9).gateways == 0
