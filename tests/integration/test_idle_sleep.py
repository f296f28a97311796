"""F4 against the database: the leader's idle timer, activity reports moving it, and
the separate gateway's activity route. Fake clock; both databases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from heteroflow.db.tables import TaskGroup
from heteroflow.services.leadership import LeaseLost

from .conftest import Api, service_body

GATEWAY = {"Authorization": "Bearer gw-token-for-tests"}
MINUTE = 60.0


def _running(api: Api, headers: dict[str, str], node_id: str, **over: Any) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=headers)
    assert r.status_code == 201, r.text
    g: dict[str, Any] = r.json()
    api.app.scheduler.run_round()
    for t in g["tasks"]:
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{t['id']}/claim", {})
        assert r.status_code == 200
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{t['id']}/report", {"status": "running"})
        assert r.status_code == 200, r.text
    return g


def _round(api: Api) -> dict[str, list[str]]:
    api.app.leadership.reconcile_once(api.clock.now())
    return api.app.idle.run_round()


def _status(api: Api, admin: dict[str, str], group_id: str) -> str:
    return str(api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()["status"])


def _last_request(api: Api, group_id: str) -> datetime | None:
    with api.app.db.session() as s:
        g = s.get(TaskGroup, group_id)
        assert g is not None
        t = g.last_request_at
    return None if t is None else t.replace(tzinfo=UTC) if t.tzinfo is None else t


def _report(api: Api, group_id: str, at: datetime) -> Any:
    body = {"activity": [{"group_id": group_id, "last_request_at": at.isoformat()}]}
    return api.client.post("/api/v1/gateway/activity", json=body, headers=GATEWAY)


@pytest.mark.feature("F4")
def test_an_idle_service_sleeps_after_its_timeout_and_a_request_resets_it(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = _running(api, admin, node, name="idle", idle_timeout_minutes=2)
    keep = _running(api, admin, node, name="never")  # idle_timeout 0: never
    api.clock.advance(2 * MINUTE - 1)
    api.heartbeat()
    assert _round(api) == {}
    # a request reported by the gateway (separate gateway: the activity route)
    r = _report(api, g["id"], api.clock.now())
    assert r.status_code == 200 and r.json() == {"updated": 1}
    api.clock.advance(2 * MINUTE - 1)
    api.heartbeat()
    assert _round(api) == {}
    assert _status(api, admin, g["id"]) == "running"
    api.clock.advance(1)
    api.heartbeat()
    slept = _round(api)
    assert slept == {g["id"]: [g["tasks"][0]["id"]]}
    assert _status(api, admin, g["id"]) == "sleeping"
    assert _status(api, admin, keep["id"]) == "running"
    events = api.client.get(f"/api/v1/task-groups/{g['id']}/events", headers=admin).json()
    assert any("idle for 2 min" in e["message"] for e in events), events
    # asleep: later rounds leave it alone
    api.clock.advance(10 * MINUTE)
    api.heartbeat()
    assert _round(api) == {}
    assert _status(api, admin, keep["id"]) == "running"


def test_activity_only_moves_forward_and_ignores_unknown_groups(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = _running(api, admin, node, idle_timeout_minutes=5)
    now = api.clock.now()
    assert _report(api, g["id"], now).json() == {"updated": 1}
    assert _report(api, g["id"], now - timedelta(seconds=30)).json() == {"updated": 0}
    assert _last_request(api, g["id"]) == now
    assert _report(api, "tg-nosuchgroup", now).json() == {"updated": 0}
    # only a gateway (or an operator) may report
    body = {"activity": [{"group_id": g["id"], "last_request_at": now.isoformat()}]}
    assert api.client.post("/api/v1/gateway/activity", json=body).status_code == 401
    alice = api.member(admin, "team-a", "alice")
    assert api.client.post("/api/v1/gateway/activity", json=body, headers=alice).status_code in (
        401,
        403,
    )
    bad = {"activity": [{"group_id": g["id"], "last_request_at": "yesterday"}]}
    assert api.client.post("/api/v1/gateway/activity", json=bad, headers=GATEWAY).status_code == 400


@pytest.mark.feature("F4")
def test_a_starting_or_waking_service_is_not_put_to_sleep(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(idle_timeout_minutes=1), headers=admin
    )
    g = r.json()
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    api.clock.advance(30 * MINUTE)  # starting for a long time: not idle, not running
    api.heartbeat()
    assert _round(api) == {}
    r = api.agent_post(node, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200
    api.clock.advance(MINUTE)
    api.heartbeat()
    assert _round(api) == {g["id"]: [task_id]}  # the timeout counts from running
    # woken: waking is not idle however long it takes; running again restarts the timer
    r = api.client.post(f"/api/v1/task-groups/{g['id']}/wake", headers=admin)
    assert r.status_code == 202, r.text
    assert _status(api, admin, g["id"]) == "waking"
    api.clock.advance(5 * MINUTE)
    api.heartbeat()
    assert _round(api) == {}
    r = api.agent_post(node, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text
    api.clock.advance(MINUTE - 1)
    api.heartbeat()
    assert _round(api) == {}
    api.clock.advance(1)
    api.heartbeat()
    assert _round(api) == {g["id"]: [task_id]}


def test_a_service_its_owner_stopped_is_not_touched_and_a_follower_writes_nothing(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = _running(api, admin, node, idle_timeout_minutes=1)
    with api.app.db.session() as s:
        row = s.get(TaskGroup, g["id"])
        assert row is not None
        row.desired = "stopped"
    api.clock.advance(10 * MINUTE)
    api.heartbeat()
    assert _round(api) == {}
    with api.app.db.session() as s:
        row = s.get(TaskGroup, g["id"])
        assert row is not None
        row.desired = "running"
    # the lease lapsed (no renewal for longer than its TTL): refused, nothing written
    api.clock.advance(api.app.settings.leader_lease_ttl_s + 1)
    with pytest.raises(LeaseLost):
        api.app.idle.run_round()
    assert _status(api, admin, g["id"]) == "running"


def test_the_settings_reach_the_idle_loop(api: Api) -> None:
    s = api.app.settings
    assert api.app.idle.interval_s == s.idle_check_interval_s == 15.0
    assert api.app.idle.minute_s == s.idle_minute_s == 60.0
    assert api.app.idle.leader_only
