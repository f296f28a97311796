"""Gangs recover as one (issue 32 item 2, G3): a stage lost with its hardware restarts the
whole gang — the other stages stop first, then every stage is replaced at once and the
scheduler places the new gang all or nothing, with one fault event for the gang; a
training stage's own failure stops the gang with it and rebuilds nothing; past the
rebuild cap the gang stops and recovery gives up. The agents are driven by hand (claim,
report), as in test_recovery.py, on a fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.recovery import RecoveryPolicy

from .conftest import Api
from .test_fault_events import faults, report, start
from .test_gang_env_api import ADDRESSES, gang, node
from .test_recovery import recovery_round


@pytest.fixture(autouse=True)
def _leads_from_the_start(api: Api) -> None:
    api.app.leadership.reconcile_once(api.clock.now())


def stages(api: Api, admin: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin)
    assert r.status_code == 200, r.text
    return sorted(r.json()["tasks"], key=lambda t: t["rank"])


def running_gang(api: Api, admin: dict[str, str], **over: Any) -> tuple[str, dict[str, str]]:
    ids = {name: node(api, name) for name in ADDRESSES}
    r = api.client.post("/api/v1/task-groups", json=gang() | over, headers=admin)
    assert r.status_code == 201, r.text
    group_id = str(r.json()["id"])
    api.app.scheduler.run_round()
    for t in stages(api, admin, group_id):
        assert t["status"] == "scheduled", t
        start(api, t["node_id"], t["id"])
    return group_id, ids


def fail(api: Api, t: dict[str, Any], fault: str, message: str) -> None:
    r = report(api, t["node_id"], t["id"], {"status": "failed", "message": message,
                                            "fault": fault})
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text


def stopped(api: Api, t: dict[str, Any]) -> None:
    r = report(api, t["node_id"], t["id"], {"status": "stopped", "message": "stopped"})
    assert r.status_code == 200, r.text


@pytest.mark.feature("G3", "E4", "E2")
def test_a_stage_lost_with_its_container_rebuilds_the_whole_gang(api: Api) -> None:
    admin = api.login()
    group_id, ids = running_gang(api, admin)
    first = stages(api, admin, group_id)
    fail(api, first[1], "container_lost", "container removed behind the agent's back")

    recovery_round(api)  # the gang restarts as one: the other stage stops first
    now = stages(api, admin, group_id)
    assert [t["id"] for t in now] == [t["id"] for t in first]  # nothing replaced yet
    assert now[0]["status"] == "stopping"
    assert now[0]["status_message"].startswith("gang restart: stage 1 ")
    recovery_round(api)  # still stopping: nothing more
    assert [t["status"] for t in stages(api, admin, group_id)] == ["stopping", "failed"]

    stopped(api, now[0])
    result = recovery_round(api)
    again = stages(api, admin, group_id)
    assert len(result.rebuilt) == 2 and {t["id"] for t in again} == set(result.rebuilt)
    assert [t["rank"] for t in again] == [0, 1]
    assert all(t["status"] == "pending" and t["rebuild_count"] == 1 for t in again)
    rebuilt = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuilt"]
    assert len(rebuilt) == 1, rebuilt  # one event for the gang
    assert rebuilt[0]["message"].startswith("gang rebuilt as one (2 stage(s)): stage 1 ")
    assert "cause: fault.container_lost" in rebuilt[0]["message"]

    api.app.scheduler.run_round()  # placed again all or nothing
    placed = stages(api, admin, group_id)
    assert [t["status"] for t in placed] == ["scheduled", "scheduled"]
    address = {node_id: ADDRESSES[name] for name, node_id in ids.items()}
    for t in placed:  # each new stage is told the new gang's master by its claim
        claim = api.agent_post(t["node_id"], f"/api/v1/agent/tasks/{t['id']}/claim", {})
        assert claim.status_code == 200, claim.text
        place = claim.json()["gang"]
        assert (place["rank"], place["world_size"]) == (t["rank"], 2)
        assert place["master_addr"] == address[placed[0]["node_id"]]


@pytest.mark.feature("G3", "E1")
def test_a_training_stages_own_failure_stops_the_gang_and_rebuilds_nothing(api: Api) -> None:
    admin = api.login()
    group_id, _ = running_gang(api, admin, task_type="training")
    first = stages(api, admin, group_id)
    fail(api, first[0], "engine_exited", "engine exited with code 1: loss is NaN")

    recovery_round(api)
    now = stages(api, admin, group_id)
    assert now[1]["status"] == "stopping"  # its peer would wait for rank 0 forever
    assert "gang stopped: stage 0" in now[1]["status_message"]
    said = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.gang_stopped"]
    assert len(said) == 1 and "start the group to run the gang again" in said[0]["message"]
    stopped(api, now[1])
    for _ in range(2):
        assert recovery_round(api).rebuilt == []
    assert len([e for e in faults(api, admin, group_id)
                if e["kind"] == "fault.gang_stopped"]) == 1  # said once
    assert [t["status"] for t in stages(api, admin, group_id)] == ["failed", "stopped"]


@pytest.mark.feature("G3", "E1")
def test_past_the_cap_the_gang_stops_and_recovery_gives_up(api: Api) -> None:
    admin = api.login()
    api.app.recovery.policy = RecoveryPolicy(max_rebuilds=0)
    group_id, _ = running_gang(api, admin)
    first = stages(api, admin, group_id)
    fail(api, first[1], "container_lost", "container removed behind the agent's back")
    result = recovery_round(api)
    assert result.rebuilt == [] and result.gave_up == [first[1]["id"]]
    now = stages(api, admin, group_id)
    assert now[0]["status"] == "stopping"
    assert now[0]["status_message"].startswith("gang stopped: recovery gave up on stage 1")
    gave_up = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuild_gave_up"]
    assert len(gave_up) == 1
    recovery_round(api)
    assert len([e for e in faults(api, admin, group_id)
                if e["kind"] == "fault.rebuild_gave_up"]) == 1


@pytest.mark.feature("G3", "E4")
def test_a_stage_on_a_lost_node_rebuilds_the_whole_gang_on_the_nodes_left(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's proof: a stage's node goes silent; after the lost-node delay the gang
    restarts as one (its other stage stops first), every stage is replaced at once with one
    event that names the lost node, and the new gang is placed on the nodes still heard."""
    admin = api.login()
    group_id, ids = running_gang(api, admin)
    first = stages(api, admin, group_id)
    monkeypatch.setitem(ADDRESSES, "gang-c", "10.0.0.3")
    spare = node(api, "gang-c")
    lost_id = first[1]["node_id"]
    lost = next(name for name, node_id in ids.items() if node_id == lost_id)
    heard = [name for name in ("gang-a", "gang-b", "gang-c") if name != lost]
    settings = api.app.settings
    lost_after = settings.node_offline_after_s + settings.node_migrate_after_s

    api.clock.advance(lost_after - 1)
    for name in heard:
        node(api, name)
    recovery_round(api)  # silent, but not for long enough: nothing moves
    assert [t["status"] for t in stages(api, admin, group_id)] == ["running", "running"]

    api.clock.advance(2)
    for name in heard:
        node(api, name)
    recovery_round(api)  # the lost stage fails; the gang restarts as one
    now = stages(api, admin, group_id)
    assert [t["id"] for t in now] == [t["id"] for t in first]  # nothing replaced yet
    assert now[1]["status"] == "failed" and f"node {lost} lost" in now[1]["status_message"]
    assert now[0]["status"] == "stopping"
    assert now[0]["status_message"].startswith("gang restart: stage 1 ")

    stopped(api, now[0])
    result = recovery_round(api)
    again = stages(api, admin, group_id)
    assert len(result.rebuilt) == 2 and {t["id"] for t in again} == set(result.rebuilt)
    assert all(t["status"] == "pending" for t in again)
    rebuilt = [e for e in faults(api, admin, group_id) if e["kind"] == "fault.rebuilt"]
    assert len(rebuilt) == 1, rebuilt  # one event for the gang
    assert rebuilt[0]["message"].startswith("gang rebuilt as one (2 stage(s)): stage 1 ")
    assert f"node {lost} lost" in rebuilt[0]["message"]

    api.app.scheduler.run_round()  # all or nothing, on the nodes still heard
    placed = stages(api, admin, group_id)
    assert [t["status"] for t in placed] == ["scheduled", "scheduled"]
    assert {t["node_id"] for t in placed} == {ids[n] for n in ids if n != lost} | {spare}
