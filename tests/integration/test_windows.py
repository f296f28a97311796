"""Schedule windows (K1) against the database: the route (what it stores, 400s naming
the field, 404 across tenants, 409 once deleted) and the leader's executor (every action
put in effect and undone, idempotence, disable and remove while in effect, the owner's
stop wins, a replica that comes up during a pause). The agent protocol is driven by hand
(claim, report) and the fake clock moves the day; both databases."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict
from heteroflow.db.tables import TaskGroup
from heteroflow.services.leadership import LeaseLost
from heteroflow.services.lifecycle.windows import WindowOutcome

from .conftest import Api, service_body

pytestmark = pytest.mark.feature("K1")

HOUR = 3600.0
# The fake clock starts at 2026-01-01 00:00 UTC (a Thursday): outside 08:00-20:00.
DAYTIME = {"timezone": "UTC", "start": "08:00", "end": "20:00", "action": "pause"}


def window_round(api: Api) -> list[WindowOutcome]:
    """One executor round as the leader (the elector renews first: it is leader-only)."""
    api.app.leadership.reconcile_once(api.clock.now())
    return api.app.windows.run_round()


def later(api: Api, hours: float) -> None:
    """Move the day on; the node heartbeats so it is still online."""
    api.clock.advance(hours * HOUR)
    api.heartbeat()


def start(api: Api, node_id: str, task_id: str) -> None:
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    report(api, node_id, task_id, "running")


def report(api: Api, node_id: str, task_id: str, status: str) -> None:
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": status})
    assert r.status_code == 200, r.text


def running(api: Api, headers: dict[str, str], node_id: str, **over: Any) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=headers)
    assert r.status_code == 201, r.text
    g: dict[str, Any] = r.json()
    api.app.scheduler.run_round()
    for t in g["tasks"]:
        start(api, node_id, t["id"])
    return g


def group(api: Api, headers: dict[str, str], group_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def statuses(api: Api, headers: dict[str, str], group_id: str) -> list[str]:
    return [t["status"] for t in group(api, headers, group_id)["tasks"]]


def put(api: Api, headers: dict[str, str], group_id: str, body: Any) -> Any:
    return api.client.put(
        f"/api/v1/task-groups/{group_id}/schedule-window", json=body, headers=headers
    )


def window_events(api: Api, headers: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}/events", headers=headers)
    assert r.status_code == 200, r.text
    return [e for e in r.json() if e["kind"].startswith("window.")]


# -- the route -------------------------------------------------------------------------


@pytest.mark.feature("A8")
def test_the_window_is_stored_read_back_and_says_where_it_stands(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node)
    body = {"timezone": "Europe/Berlin", "days": ["fri", "mon", "tue", "wed", "thu"],
            "start": "08:00", "end": "20:00", "action": "pause"}
    r = put(api, admin, g["id"], body)
    assert r.status_code == 200, r.text
    read = r.json()
    stored = {**body, "days": ["mon", "tue", "wed", "thu", "fri"], "enabled": True}
    assert read["schedule_window"] == stored
    # Thursday 01:00 in Berlin: outside; it opens at 08:00 CET = 07:00 UTC
    assert read["inside"] is False and read["changes_at"].startswith("2026-01-01T07:00:00")
    assert read["summary"].startswith("runs mon-fri 08:00-20:00 Europe/Berlin; outside: paused")
    assert read["window_action"] == "" and read["window_saved_replicas"] is None
    got = api.client.get(f"/api/v1/task-groups/{g['id']}/schedule-window", headers=admin)
    assert got.json() == read
    assert group(api, admin, g["id"])["schedule_window"] == stored
    r = api.client.get(f"/api/v1/task-groups/{g['id']}/events", headers=admin)
    assert any(e["kind"] == "group.config_changed" and "schedule window set by admin" in
               e["message"] for e in r.json())
    # nothing acts at once: the executor does, at its next round
    assert statuses(api, admin, g["id"]) == ["running"]
    # removed: back to none
    r = api.client.delete(f"/api/v1/task-groups/{g['id']}/schedule-window", headers=admin)
    assert r.status_code == 200 and r.json()["schedule_window"] == {}
    assert r.json()["inside"] is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**DAYTIME, "timezone": "Europe/Atlantis"}, "schedule_window.timezone"),
        ({**DAYTIME, "days": ["mon", "someday"]}, "schedule_window.days.1"),
        ({**DAYTIME, "start": "8am"}, "schedule_window.start"),
        ({**DAYTIME, "end": "08:00"}, "schedule_window.end"),
        ({**DAYTIME, "replicas": 1}, "schedule_window.replicas"),
        ({**DAYTIME, "action": "scale"}, "schedule_window.replicas"),
        # the group runs 1 replica with bounds [1, 1]: a scale window has nowhere to go
        ({**DAYTIME, "action": "scale", "replicas": 1}, "schedule_window.replicas"),
        ({**DAYTIME, "action": "nap"}, "schedule_window.action"),
        ({**DAYTIME, "grace_minutes": 5}, "schedule_window.grace_minutes"),
        ([DAYTIME], "schedule_window"),
    ],
)
def test_a_bad_window_is_a_400_naming_its_field(api: Api, body: Any, field: str) -> None:
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    gid = r.json()["id"]
    r = put(api, admin, gid, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    assert r.json()["error"]["message"]
    assert group(api, admin, gid)["schedule_window"] == {}
    # the same at create
    if isinstance(body, dict):
        r = api.client.post("/api/v1/task-groups", json=service_body(
            name="svc2", schedule_window=body), headers=admin)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == field


def test_create_takes_a_window_and_the_group_rules_hold_there(api: Api) -> None:
    admin = api.login()
    r = api.client.post(
        "/api/v1/task-groups",
        json=service_body(max_replicas=3, schedule_window={**DAYTIME, "action": "stop"}),
        headers=admin,
    )
    assert r.status_code == 201, r.text
    assert r.json()["schedule_window"]["action"] == "stop"
    # pause is sleep: inference services only
    training = {"name": "train", "task_type": "training",
                "task": {"image": "busybox:1", "gpu_required": 0, "command": ["sleep", "9"]},
                "schedule_window": DAYTIME}
    r = api.client.post("/api/v1/task-groups", json=training, headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "schedule_window.action"


def test_another_tenants_group_is_404_and_a_deleted_one_409(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    bob = api.member(admin, "team-b", "bob")
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=alice)
    gid = r.json()["id"]
    assert put(api, alice, gid, DAYTIME).status_code == 200
    path = f"/api/v1/task-groups/{gid}/schedule-window"
    assert put(api, bob, gid, DAYTIME).status_code == 404
    assert api.client.get(path, headers=bob).status_code == 404
    assert api.client.delete(path, headers=bob).status_code == 404
    assert put(api, admin, gid, DAYTIME).status_code == 200  # an operator may
    assert put(api, alice, "tg-nosuchgroup", DAYTIME).status_code == 404
    assert api.client.delete(f"/api/v1/task-groups/{gid}", headers=alice).status_code == 204
    r = put(api, alice, gid, DAYTIME)
    assert r.status_code == 409 and "deleted" in r.json()["error"]["message"]
    assert put(api, bob, gid, DAYTIME).status_code == 404  # still nothing to bob


# -- the executor ----------------------------------------------------------------------


@pytest.mark.feature("E2")
def test_outside_the_window_the_service_sleeps_and_back_inside_it_wakes(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node)
    task_id = g["tasks"][0]["id"]
    assert put(api, admin, g["id"], DAYTIME).status_code == 200

    done = window_round(api)
    assert [(o.group_id, o.step, o.action, o.tasks) for o in done] == [
        (g["id"], "act", "pause", [task_id])
    ]
    now = group(api, admin, g["id"])
    assert now["status"] == "sleeping" and now["tasks"][0]["status"] == "sleeping"
    assert (now["window_action"], now["window_saved_replicas"]) == ("pause", 1)
    assert "outside its schedule window" in now["tasks"][0]["status_message"]
    [paused] = window_events(api, admin, g["id"])
    assert (paused["kind"], paused["from_status"], paused["to_status"]) == (
        "window.pause", "", "pause"
    )
    assert "paused: 1 task(s) put to sleep" in paused["message"]
    assert "1 replica(s) saved" in paused["message"]
    assert "opens again Thu 2026-01-01 08:00 UTC" in paused["message"]

    # idempotent: later rounds outside change nothing and write nothing
    later(api, 4)
    assert window_round(api) == []
    assert len(window_events(api, admin, g["id"])) == 1

    later(api, 4)  # 08:00: inside
    done = window_round(api)
    assert [(o.step, o.action, o.tasks) for o in done] == [("restore", "pause", [task_id])]
    now = group(api, admin, g["id"])
    assert now["tasks"][0]["status"] == "waking"
    assert (now["window_action"], now["window_saved_replicas"]) == ("", None)
    resumed = window_events(api, admin, g["id"])[-1]
    assert (resumed["kind"], resumed["from_status"], resumed["to_status"]) == (
        "window.resume", "pause", ""
    )
    assert resumed["message"].startswith("the window opened: resumed: 1 task(s) woken")
    report(api, node, task_id, "running")
    assert window_round(api) == []
    assert statuses(api, admin, g["id"]) == ["running"]

    later(api, 12)  # 20:00: closed again
    admin = api.login()  # a token lasts 12 h
    assert [o.step for o in window_round(api)] == ["act"]
    assert statuses(api, admin, g["id"]) == ["sleeping"]


def test_a_window_disabled_or_removed_while_in_effect_is_restored_next_round(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node)
    task_id = g["tasks"][0]["id"]
    put(api, admin, g["id"], DAYTIME)
    window_round(api)
    assert statuses(api, admin, g["id"]) == ["sleeping"]

    r = put(api, admin, g["id"], {**DAYTIME, "enabled": False})
    assert r.status_code == 200 and r.json()["window_action"] == "pause"  # until the round
    assert [o.step for o in window_round(api)] == ["restore"]
    assert statuses(api, admin, g["id"]) == ["waking"]
    assert "the window was disabled: resumed" in window_events(api, admin, g["id"])[-1]["message"]
    report(api, node, task_id, "running")
    assert window_round(api) == []  # disabled: nothing more

    put(api, admin, g["id"], {**DAYTIME, "enabled": True})
    assert [o.step for o in window_round(api)] == ["act"]
    assert statuses(api, admin, g["id"]) == ["sleeping"]
    r = api.client.delete(f"/api/v1/task-groups/{g['id']}/schedule-window", headers=admin)
    assert r.status_code == 200
    assert [o.step for o in window_round(api)] == ["restore"]
    assert statuses(api, admin, g["id"]) == ["waking"]
    assert "the window was removed: resumed" in window_events(api, admin, g["id"])[-1]["message"]


def test_a_service_its_owner_stopped_is_left_stopped(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node)
    put(api, admin, g["id"], DAYTIME)
    window_round(api)
    assert statuses(api, admin, g["id"]) == ["sleeping"]
    r = api.client.post(f"/api/v1/task-groups/{g['id']}/stop", headers=admin)
    assert r.status_code == 200, r.text
    assert window_round(api) == []
    later(api, 9)  # inside: the pause is not undone, only cleared
    done = window_round(api)
    assert [(o.step, o.tasks) for o in done] == [("release", [])]
    now = group(api, admin, g["id"])
    assert now["desired"] == "stopped" and now["tasks"][0]["status"] == "stopped"
    assert now["window_action"] == ""
    assert "stopped by its owner meanwhile" in window_events(api, admin, g["id"])[-1]["message"]
    later(api, 12)  # closed again: a stopped service is not acted on
    admin = api.login()  # a token lasts 12 h
    assert window_round(api) == []
    assert group(api, admin, g["id"])["window_action"] == ""


def test_stop_stops_the_service_and_is_not_undone_when_the_window_opens(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node)
    task_id = g["tasks"][0]["id"]
    put(api, admin, g["id"], {**DAYTIME, "action": "stop"})
    assert [(o.step, o.action) for o in window_round(api)] == [("act", "stop")]
    now = group(api, admin, g["id"])
    assert (now["desired"], now["tasks"][0]["status"]) == ("stopped", "stopping")
    assert (now["window_action"], now["window_saved_replicas"]) == ("stop", 1)
    report(api, node, task_id, "stopped")  # the agent stopped the engine
    assert window_round(api) == []
    r = api.client.get(f"/api/v1/task-groups/{g['id']}/events", headers=admin)
    assert any(e["kind"] == "group.desired" and e["to_status"] == "stopped" and
               "outside its schedule window" in e["message"] for e in r.json())

    later(api, 9)  # inside
    assert [o.step for o in window_round(api)] == ["release"]
    now = group(api, admin, g["id"])
    assert (now["desired"], now["status"], now["window_action"]) == ("stopped", "stopped", "")
    assert "it stays stopped" in window_events(api, admin, g["id"])[-1]["message"]
    # its owner starts it; the next closing stops it again
    r = api.client.post(f"/api/v1/task-groups/{g['id']}/start", headers=admin)
    assert r.status_code == 200, r.text
    api.app.scheduler.run_round()
    start(api, node, group(api, admin, g["id"])["tasks"][0]["id"])
    later(api, 12)
    admin = api.login()  # a token lasts 12 h
    assert [o.step for o in window_round(api)] == ["act"]
    assert group(api, admin, g["id"])["desired"] == "stopped"


def test_scale_goes_down_to_its_replicas_and_back_to_the_saved_count(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node, max_replicas=3)
    r = api.client.put(f"/api/v1/task-groups/{g['id']}/scale", json={"replicas": 3},
                       headers=admin)
    assert r.status_code == 200, r.text
    api.app.scheduler.run_round()
    for t in group(api, admin, g["id"])["tasks"]:
        if t["status"] == "scheduled":
            start(api, node, t["id"])
    assert statuses(api, admin, g["id"]) == ["running"] * 3
    r = put(api, admin, g["id"], {**DAYTIME, "action": "scale", "replicas": 1})
    assert r.status_code == 200, r.text

    assert [(o.step, o.action) for o in window_round(api)] == [("act", "scale")]
    now = group(api, admin, g["id"])
    assert (now["current_replicas"], now["window_action"], now["window_saved_replicas"]) == (
        1, "scale", 3
    )
    assert len(now["tasks"]) == 1 and now["tasks"][0]["rank"] == 0
    assert "scaled down from 3 to 1 replica(s); 3 replica(s) saved" in (
        window_events(api, admin, g["id"])[-1]["message"]
    )
    assert window_round(api) == []
    # while it is in effect a scale-window PUT compares with the saved count (3)
    assert put(api, admin, g["id"], {**DAYTIME, "action": "scale", "replicas": 2}
               ).status_code == 200
    # and a manual scale waits for the window (the autoscaler skips it too)
    r = api.client.put(f"/api/v1/task-groups/{g['id']}/scale", json={"replicas": 2},
                       headers=admin)
    assert r.status_code == 409 and "schedule window" in r.json()["error"]["message"]

    later(api, 9)  # inside
    assert [(o.step, o.action) for o in window_round(api)] == [("restore", "scale")]
    now = group(api, admin, g["id"])
    assert (now["current_replicas"], now["window_action"]) == (3, "")
    assert len(now["tasks"]) == 3
    assert "the window opened: scaled back from 1 to 3 replica(s)" in (
        window_events(api, admin, g["id"])[-1]["message"]
    )


def test_a_pause_puts_back_to_sleep_a_replica_that_came_up_by_a_start_not_a_woken_one(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node, max_replicas=2)
    api.client.put(f"/api/v1/task-groups/{g['id']}/scale", json={"replicas": 2}, headers=admin)
    api.app.scheduler.run_round()
    second = next(t for t in group(api, admin, g["id"])["tasks"] if t["rank"] == 1)
    assert api.agent_post(node, f"/api/v1/agent/tasks/{second['id']}/claim", {}).status_code == 200
    put(api, admin, g["id"], DAYTIME)

    # the window closes while the second replica is still starting
    [act] = window_round(api)
    assert act.tasks == [g["tasks"][0]["id"]]
    assert "left as they are: " + second["id"] + " (starting)" in act.message
    assert statuses(api, admin, g["id"]) == ["sleeping", "starting"]
    report(api, node, second["id"], "running")
    [hold] = window_round(api)
    assert (hold.step, hold.tasks) == ("hold", [second["id"]])
    assert statuses(api, admin, g["id"]) == ["sleeping", "sleeping"]
    last = window_events(api, admin, g["id"])[-1]
    assert (last["kind"], last["from_status"], last["to_status"]) == (
        "window.pause", "pause", "pause"
    )
    assert window_round(api) == []

    # woken by a person (or a request): left awake
    r = api.client.post(f"/api/v1/task-groups/{g['id']}/wake", headers=admin)
    assert r.status_code == 202, r.text
    for t in group(api, admin, g["id"])["tasks"]:
        report(api, node, t["id"], "running")
    assert window_round(api) == []
    assert statuses(api, admin, g["id"]) == ["running", "running"]

    # a woken replica that fails is rebuilt by the recovery loop: its rebuild is put
    # back to sleep once it runs
    first = group(api, admin, g["id"])["tasks"][0]["id"]
    report(api, node, first, "failed")
    rebuilt = api.app.recovery.run_round().rebuilt
    assert len(rebuilt) == 1
    api.app.scheduler.run_round()
    start(api, node, rebuilt[0])
    [again] = window_round(api)
    assert again.tasks == rebuilt
    assert statuses(api, admin, g["id"]) == ["sleeping", "running"]


def test_a_rolling_update_makes_the_window_wait_and_a_follower_writes_nothing(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node)
    put(api, admin, g["id"], DAYTIME)
    with api.app.db.session() as s:
        s.execute(update(TaskGroup).where(TaskGroup.id == g["id"]).values(rollout_holder="srv-x"))
    assert window_round(api) == []
    assert statuses(api, admin, g["id"]) == ["running"]
    with api.app.db.session() as s:
        s.execute(update(TaskGroup).where(TaskGroup.id == g["id"]).values(rollout_holder=""))
    # the lease lapsed (no renewal for longer than its TTL): refused, nothing written
    api.clock.advance(api.app.settings.leader_lease_ttl_s + 1)
    with pytest.raises(LeaseLost):
        api.app.windows.run_round()
    assert statuses(api, admin, g["id"]) == ["running"]
    api.heartbeat()
    assert [o.step for o in window_round(api)] == ["act"]


def test_the_setting_reaches_the_loop(api: Api) -> None:
    s = api.app.settings
    assert api.app.windows.interval_s == s.schedule_window_interval_s == 60.0
    assert api.app.windows.leader_only


def test_an_action_that_cannot_run_leaves_nothing_half_done_and_is_tried_again(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    g = running(api, admin, node, max_replicas=2)
    api.client.put(f"/api/v1/task-groups/{g['id']}/scale", json={"replicas": 2}, headers=admin)
    api.app.scheduler.run_round()
    for t in group(api, admin, g["id"])["tasks"]:
        if t["status"] == "scheduled":
            start(api, node, t["id"])
    put(api, admin, g["id"], {**DAYTIME, "action": "scale", "replicas": 1})
    real = api.app.windows.scaler

    def refuses(s: Session, clock: Clock, group_id: str, replicas: int, reason: str) -> object:
        raise Conflict("the scaler is busy")

    api.app.windows.scaler = refuses
    for _ in range(3):
        [failed] = window_round(api)
        assert failed.step == "failed" and "the scaler is busy" in failed.message
    now = group(api, admin, g["id"])
    # the saved count and the action were rolled back with the failed scale
    assert (now["window_action"], now["window_saved_replicas"], now["current_replicas"]) == (
        "", None, 2
    )
    failures = [e for e in window_events(api, admin, g["id"]) if e["kind"] == "window.failed"]
    assert len(failures) == 1  # once per distinct reason
    assert "the scale at its closing could not run: the scaler is busy" in failures[0]["message"]
    api.app.windows.scaler = real
    assert [o.step for o in window_round(api)] == ["act"]
    assert group(api, admin, g["id"])["current_replicas"] == 1
