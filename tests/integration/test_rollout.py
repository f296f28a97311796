"""Rolling update and recreate (J1-J4) on a real database with a fake clock: the API
starts an update, the driver (``app.rollouts``) advances it round by round, and the agent
protocol is driven by hand (claim, report running / failed / stopped), as in
test_recovery.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from heteroflow import cli
from heteroflow.core.rollout import CANDIDATE

from .conftest import NODE_TOKEN, Api, service_body
from .test_fault_events import create, events, report, start
from .test_group_start_stop import logged_in  # noqa: F401 - a fixture
from .test_recovery import fail, group, recovery_round, task

NEW_IMAGE = "ghcr.io/ggml-org/llama.cpp:server-b2"


def two_replicas(api: Api, admin: dict[str, str], **over: Any) -> tuple[str, str, list[str]]:
    """A running service of two replicas (split); (group, node, [task of rank 0, 1])."""
    node_id = api.heartbeat()
    group_id, _ = create(api, admin, service_body(parallelism="split", world_size=2, **over))
    api.app.scheduler.run_round()
    tasks = sorted(group(api, admin, group_id)["tasks"], key=lambda t: t["rank"])
    for t in tasks:
        start(api, node_id, t["id"])
    assert group(api, admin, group_id)["status"] == "running"
    return group_id, node_id, [t["id"] for t in tasks]


def put_update(
    api: Api, headers: dict[str, str], group_id: str, **body: Any
) -> tuple[int, dict[str, Any]]:
    r = api.client.put(f"/api/v1/task-groups/{group_id}/update", json=body, headers=headers)
    return r.status_code, r.json()


def drive(api: Api, advance_s: float = 0.0) -> None:
    """Move the clock, keep the node online, and run one driver round."""
    if advance_s:
        api.clock.advance(advance_s)
    api.heartbeat()
    api.app.rollouts.drive_round()


def candidates(api: Api, admin: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    """The live new replicas of the group's rollout (not current yet)."""
    from sqlalchemy import select

    from heteroflow.db.tables import Task

    with api.app.db.session() as s:
        ids = list(
            s.scalars(
                select(Task.id)
                .where(Task.group_id == group_id, Task.replaced_by == CANDIDATE)
                .order_by(Task.created_at)
            )
        )
    return [t for t in (task(api, admin, i) for i in ids)
            if t["status"] not in ("stopped", "failed", "stopping")]


def bring_up(api: Api, admin: dict[str, str], node_id: str, group_id: str) -> str:
    """Place and start the rollout's single live candidate; its id."""
    api.app.scheduler.run_round()
    (c,) = candidates(api, admin, group_id)
    assert c["status"] == "scheduled", c
    start(api, node_id, c["id"])
    return str(c["id"])


def state(api: Api, admin: dict[str, str], group_id: str) -> tuple[str | None, str]:
    g = group(api, admin, group_id)
    return g["rolling_update_state"], g["rolling_update_message"] or ""


def rollout_events(api: Api, admin: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    return [e for e in events(api, admin, group_id) if e["kind"].startswith("rollout.")]


def roll_one_batch(
    api: Api, admin: dict[str, str], node_id: str, group_id: str, old: str,
    seen: Callable[[str], None] = lambda phase: None,
) -> str:
    """One batch of one rank through every phase; the new replica's id.

    `seen(phase)` is called while each phase holds, so a watcher (the CLI's poll)
    can be waited for instead of raced.
    """
    drive(api)  # the candidate is created
    assert "new generation starting" in state(api, admin, group_id)[1]
    seen("new generation starting")
    new = bring_up(api, admin, node_id, group_id)
    drive(api)  # running, settling: the old one still serves undrained
    assert task(api, admin, old)["draining"] is False
    drive(api, 2.5)  # settled: the old replica drains
    assert task(api, admin, old)["draining"] is True
    assert "old generation draining" in state(api, admin, group_id)[1]
    seen("old generation draining")
    drive(api, 5)  # no gateway report: it waits out the drain timeout
    assert task(api, admin, old)["status"] == "running"
    drive(api, 26)
    was = task(api, admin, old)
    assert (was["status"], was["replaced_by"]) == ("stopping", new)
    assert task(api, admin, new)["replaced_by"] == ""
    assert report(api, node_id, old, {"status": "stopped"}).status_code == 200
    return new


@pytest.mark.feature("J1", "J3")
def test_a_rolling_update_replaces_every_replica_batch_by_batch(api: Api) -> None:
    admin = api.login()
    group_id, node_id, (old0, old1) = two_replicas(api, admin)

    code, g = put_update(api, admin, group_id, image=NEW_IMAGE, strategy="rolling")
    assert code == 200, g
    assert g["current_generation"] == 2 and g["rolling_update_state"] == "rolling"
    assert "submitted" in g["rolling_update_message"]
    # J3: one compare-and-set took the lease with the bump; a second update is refused
    code, again = put_update(api, admin, group_id, image=NEW_IMAGE)
    assert code == 409 and "already running" in again["error"]["message"], again

    new0 = roll_one_batch(api, admin, node_id, group_id, old0)
    g = group(api, admin, group_id)
    assert sorted((t["rank"], t["generation"]) for t in g["tasks"]) == [(0, 2), (1, 1)]
    assert g["status"] == "running"  # never "stopping" nor "scheduling" in between
    n0 = task(api, admin, new0)
    # J3: the intent is inherited, the image is the new one, placement and pool port new
    assert (n0["image"], n0["model_path"], n0["generation"]) == (NEW_IMAGE, "tiny.gguf", 2)
    assert n0["ports"][0]["host_port"] != task(api, admin, old0)["ports"][0]["host_port"]

    new1 = roll_one_batch(api, admin, node_id, group_id, old1)
    drive(api)
    st, message = state(api, admin, group_id)
    assert st == "done" and "generation 2 serves on every replica" in message, message
    g = group(api, admin, group_id)
    assert sorted(t["id"] for t in g["tasks"]) == sorted([new0, new1])
    assert {t["generation"] for t in g["tasks"]} == {2} and g["status"] == "running"
    kinds = [e["kind"] for e in rollout_events(api, admin, group_id)]
    assert kinds[0] == "rollout.started" and kinds[-1] == "rollout.done"
    assert kinds.count("rollout.batch") >= 6
    drains = [e for e in events(api, admin, group_id) if e["kind"] == "drain"]
    assert {e["task_id"] for e in drains} == {old0, old1}
    # the lease is released: another update may start
    code, g = put_update(api, admin, group_id, engine_args=["-c", "512"])
    assert code == 200 and g["current_generation"] == 3, g


@pytest.mark.feature("J1")
def test_a_batch_that_never_runs_is_tried_again_then_rolled_back(api: Api) -> None:
    admin = api.login()
    group_id, node_id, olds = two_replicas(api, admin)
    code, _ = put_update(api, admin, group_id, image=NEW_IMAGE, engine_args=["--bogus"])
    assert code == 200
    tried = []
    for attempt in range(1, 5):
        drive(api)
        assert f"attempt {attempt} of 4" in state(api, admin, group_id)[1]
        api.app.scheduler.run_round()
        (c,) = candidates(api, admin, group_id)
        tried.append(c["id"])
        assert api.agent_post(
            node_id, f"/api/v1/agent/tasks/{c['id']}/claim", {}
        ).status_code == 200
        fail(api, node_id, c["id"], "engine exited with code 2; unknown flag --bogus")
        # the old generation serves throughout: never drained, never stopped
        for o in olds:
            t = task(api, admin, o)
            assert (t["status"], t["draining"], t["replaced_by"]) == ("running", False, "")
        assert group(api, admin, group_id)["status"] == "running"
        # recovery does not rebuild the rollout's failed replica (it is not current)
        assert recovery_round(api).rebuilt == []
        drive(api)
    assert state(api, admin, group_id)[0] == "rolling_back"
    drive(api)  # nothing was replaced yet: nothing to restore
    st, message = state(api, admin, group_id)
    assert st == "failed", message
    assert "failed 4 times" in message and "unknown flag --bogus" in message
    assert "rolled back: generation 1 serves" in message
    assert len(set(tried)) == 4
    kinds = [e["kind"] for e in rollout_events(api, admin, group_id)]
    assert kinds.count("rollout.retry") == 3 and "rollout.rollback" in kinds
    assert kinds[-1] == "rollout.failed"
    g = group(api, admin, group_id)
    assert sorted(t["id"] for t in g["tasks"]) == sorted(olds) and g["current_generation"] == 2
    # the update can be submitted again
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200


@pytest.mark.feature("J1")
def test_a_failure_in_a_later_batch_restores_the_replicas_already_replaced(api: Api) -> None:
    admin = api.login()
    group_id, node_id, (old0, old1) = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    new0 = roll_one_batch(api, admin, node_id, group_id, old0)
    for _ in range(4):  # batch 2: every attempt fails
        drive(api)
        api.app.scheduler.run_round()
        (c,) = candidates(api, admin, group_id)
        api.agent_post(node_id, f"/api/v1/agent/tasks/{c['id']}/claim", {})
        fail(api, node_id, c["id"], "engine exited with code 1")
        drive(api)
    st, message = state(api, admin, group_id)
    assert st == "rolling_back", message
    # rank 0 gets generation 1 back: a copy of the replica the update retired
    drive(api)
    (restore,) = candidates(api, admin, group_id)
    r = task(api, admin, restore["id"])
    assert (r["rank"], r["generation"], r["image"]) == (0, 1, task(api, admin, old0)["image"])
    bring_up(api, admin, node_id, group_id)
    drive(api, 2.5)  # settled: the new generation's replica drains
    assert task(api, admin, new0)["draining"] is True
    drive(api, 31)
    assert task(api, admin, new0)["status"] == "stopping"
    drive(api)
    st, message = state(api, admin, group_id)
    assert st == "failed" and "rolled back: generation 1 serves" in message, message
    g = group(api, admin, group_id)
    assert sorted((t["rank"], t["generation"]) for t in g["tasks"]) == [(0, 1), (1, 1)]
    assert old1 in {t["id"] for t in g["tasks"]}


@pytest.mark.feature("J2")
def test_recreate_stops_every_replica_then_creates_every_one(api: Api) -> None:
    admin = api.login()
    group_id, node_id, olds = two_replicas(api, admin)
    code, g = put_update(api, admin, group_id, image=NEW_IMAGE, strategy="recreate")
    assert code == 200 and g["rolling_update_state"] == "recreating", g
    prepull_all(api, node_id, olds)  # the new image on their node first (H7)
    drive(api)  # every old replica drains first
    assert all(task(api, admin, o)["draining"] for o in olds)
    drive(api, 31)  # then stops (the drain timeout, no gateway report)
    assert [task(api, admin, o)["status"] for o in olds] == ["stopping", "stopping"]
    for o in olds:
        report(api, node_id, o, {"status": "stopped"})
    drive(api)  # every new replica is created at once
    api.app.scheduler.run_round()
    news = candidates(api, admin, group_id)
    assert len(news) == 2 and {t["generation"] for t in news} == {2}
    for t in news:
        start(api, node_id, t["id"])
    drive(api)
    drive(api)
    g = group(api, admin, group_id)
    assert g["rolling_update_state"] == "done", g["rolling_update_message"]
    assert sorted(t["id"] for t in g["tasks"]) == sorted(t["id"] for t in news)
    assert g["status"] == "running"


@pytest.mark.feature("J4")
def test_a_lapsed_lease_fails_the_update_and_it_can_be_resubmitted(api: Api) -> None:
    admin = api.login()
    group_id, _, olds = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    drive(api)
    api.app.scheduler.run_round()
    (c,) = candidates(api, admin, group_id)
    # the holder dies: nobody renews; the scan (every instance) finds the lapsed lease
    api.clock.advance(59)
    assert api.app.rollouts.scan_round().failed == []  # not yet lapsed
    api.clock.advance(2)
    result = api.app.rollouts.scan_round()
    assert result.failed == [group_id] and result.stopped == [c["id"]]
    st, message = state(api, admin, group_id)
    assert st == "failed" and "stopped renewing its lease" in message, message
    assert "resubmit" in message and "generation 1 serves" in message
    assert task(api, admin, c["id"])["status"] == "stopped"  # the half-made one
    g = group(api, admin, group_id)
    assert sorted(t["id"] for t in g["tasks"]) == sorted(olds)
    # the dead holder's driver (were it paused, not dead) is refused: lease lost
    assert api.app.rollouts.drive_round() == {}
    code, g = put_update(api, admin, group_id, image=NEW_IMAGE)
    assert code == 200 and g["current_generation"] == 3 and g["rolling_update_state"] == "rolling"


@pytest.mark.feature("J3")
def test_update_requests_are_checked_like_a_create(api: Api) -> None:
    admin = api.login()
    group_id, _, _ = two_replicas(api, admin)

    def bad(code: int, field: str | None, **body: Any) -> str:
        got, answer = put_update(api, admin, group_id, **body)
        assert got == code, answer
        assert answer["error"].get("field") == field, answer
        return str(answer["error"]["message"])

    assert "nothing to update" in bad(400, "image")
    bad(400, "image", image="Not A Valid Image")
    bad(400, "gpu_required", image=NEW_IMAGE, gpu_required=2)
    assert "together with a new image" in bad(400, "kv_offload_gb", kv_offload_gb=8)
    assert "only vLLM" in bad(400, "kv_offload_gb", image=NEW_IMAGE, kv_offload_gb=8)
    assert "vllm image" in bad(400, "image", image="vllm/vllm-openai:v0.10.0")
    bad(400, "env[0]", image=NEW_IMAGE, env=["LD_PRELOAD=/x.so"])
    assert "may not set" in bad(400, "engine_args", engine_args=["--port", "1"])
    bad(400, "batch_size", image=NEW_IMAGE, batch_size=0)
    bad(400, "strategy", image=NEW_IMAGE, strategy="blue-green")
    # other tenants do not see it
    member = api.member(admin, "tn-other", "other")
    r = api.client.put(
        f"/api/v1/task-groups/{group_id}/update", json={"image": NEW_IMAGE}, headers=member
    )
    assert r.status_code == 404, r.text
    # a stopped service is not updated
    assert api.client.post(f"/api/v1/task-groups/{group_id}/stop", headers=admin).status_code == 200
    assert "start it" in bad(409, None, image=NEW_IMAGE)
    assert group(api, admin, group_id)["current_generation"] == 1


@pytest.mark.feature("J1")
def test_a_stop_during_the_update_ends_it_and_stops_its_new_replicas(api: Api) -> None:
    admin = api.login()
    group_id, node_id, _ = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    drive(api)
    new = bring_up(api, admin, node_id, group_id)
    assert api.client.post(f"/api/v1/task-groups/{group_id}/stop", headers=admin).status_code == 200
    drive(api)
    st, message = state(api, admin, group_id)
    assert st == "failed" and "stopped during the update" in message, message
    assert task(api, admin, new)["status"] == "stopping"
    assert group(api, admin, group_id)["status"] == "stopping"


# ---- the CLI: services update --wait follows the batches ---------------------------


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the CLI is what is tested
@pytest.mark.usefixtures("logged_in")
def test_cli_update_follows_the_batches(
    api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("heteroflow.cmd.waiting.POLL_S", 0.02)
    admin = api.login()
    group_id, node_id, (old0, old1) = two_replicas(api, admin)
    codes: list[int] = []
    waiting = threading.Thread(
        target=lambda: codes.append(
            cli.main(["services", "update", group_id, "--image", NEW_IMAGE, "--wait",
                      "--timeout", "30"])
        )
    )
    waiting.start()
    deadline = time.monotonic() + 10
    while group(api, admin, group_id)["current_generation"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    printed: list[str] = []

    def cli_printed(phase: str) -> None:
        """Hold the phase until the CLI's poll has printed it (no race with its timer)."""
        mark, deadline = len(printed), time.monotonic() + 10
        while phase not in "".join(printed[mark:]):
            assert time.monotonic() < deadline, "".join(printed)
            time.sleep(0.02)
            printed.append(capsys.readouterr().out)

    for old in (old0, old1):
        roll_one_batch(api, admin, node_id, group_id, old, seen=cli_printed)
    drive(api)
    waiting.join(15)
    printed.append(capsys.readouterr().out)
    out = "".join(printed)
    assert codes == [0], out
    assert f"updating {group_id} to generation 2 (rolling)" in out
    assert "] batch 1/2 (rank 0): new generation starting (attempt 1 of 4)" in out
    assert "] batch 2/2 (rank 1): new generation running; old generation draining" in out
    assert f"service {group_id} runs generation 2: done: generation 2 serves" in out

    # a failed update is exit 1 with the reason
    assert cli.main(["services", "update", group_id, "--engine-arg=--port", "--engine-arg=1"]) == 1
    assert "error 400" in capsys.readouterr().err


@pytest.mark.feature("J1", "M11")
def test_the_old_replica_stops_once_every_gateway_reports_it_drained(api: Api) -> None:
    from heteroflow.schemas.usage import BackendLoad, GatewayLoad
    from heteroflow.services.tenancy.usage import write_load

    def gateway_says(task_id: str, *, draining: bool, in_flight: int) -> None:
        load = GatewayLoad("gw-test", (BackendLoad(task_id, group_id, draining, in_flight, 0.0),))
        with api.app.db.session() as s:
            write_load(s, load, api.clock.now())

    admin = api.login()
    group_id, node_id, (old0, _) = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    drive(api)
    new0 = bring_up(api, admin, node_id, group_id)
    drive(api, 2.5)
    assert task(api, admin, old0)["draining"] is True
    api.clock.advance(2.5)
    gateway_says(old0, draining=False, in_flight=0)  # this gateway still routes to it
    drive(api)
    assert task(api, admin, old0)["status"] == "running"
    gateway_says(old0, draining=True, in_flight=1)  # a request is still on it
    drive(api, 1)
    assert task(api, admin, old0)["status"] == "running"
    gateway_says(old0, draining=True, in_flight=0)
    drive(api)  # 4 s after the mark, long before the 30 s drain timeout
    was = task(api, admin, old0)
    assert (was["status"], was["replaced_by"]) == ("stopping", new0)


@pytest.mark.feature("J1")
def test_recovery_leaves_a_group_alone_while_its_update_runs(api: Api) -> None:
    admin = api.login()
    group_id, node_id, (old0, old1) = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    fail(api, node_id, old1, "engine exited with code 9")  # an old replica fails meanwhile
    assert recovery_round(api).rebuilt == []  # the update owns the replicas: no rebuild
    roll_one_batch(api, admin, node_id, group_id, old0)
    drive(api)  # batch 2: rank 1's failed replica is simply replaced
    new1 = bring_up(api, admin, node_id, group_id)
    drive(api, 2.5)  # nothing to drain on rank 1: switched at once
    assert task(api, admin, old1)["replaced_by"] == new1
    drive(api)
    assert state(api, admin, group_id)[0] == "done"
    assert {t["generation"] for t in group(api, admin, group_id)["tasks"]} == {2}
    assert recovery_round(api).rebuilt == []


@pytest.mark.feature("J4")
def test_a_server_that_starts_scans_at_once_then_every_scan_interval(api: Api) -> None:
    from heteroflow.controllers.rollout import Rollouts

    admin = api.login()
    group_id, _, _ = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    drive(api)
    api.clock.advance(61)  # its holder is gone; another instance starts
    fresh = Rollouts(
        api.app.db, api.clock, "srv-restarted", interval_s=1, scan_interval_s=30,
        policy=api.app.settings.rollout_policy(),
    )
    fresh.reconcile_once(api.clock.now())  # the first round scans
    st, message = state(api, admin, group_id)
    assert st == "failed" and "stopped renewing its lease" in message
    assert fresh._next_scan == api.clock.now() + timedelta(seconds=30)


# ---- issue 26: an update that cannot run is refused; a stuck one fails and lets go ------


def process_node_service(api: Api, member: dict[str, str]) -> tuple[str, str, str]:
    """A member's llama.cpp service running on a process-runtime node: (group, node, task)."""
    node_id = api.heartbeat("proc-node", runtime="process")
    group_id, task_id = create(api, member, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    assert group(api, member, group_id)["status"] == "running"
    return group_id, node_id, task_id


@pytest.mark.feature("J3")
def test_an_update_the_fleet_cannot_run_is_refused_like_its_create(api: Api) -> None:
    """Attack: a member's update whose new task carries a ``command`` was accepted (200)
    where only the process runtime runs, then stayed ``rolling`` for ever. The create's
    rule (``planning.check_task``) refuses it at the request; the group is unchanged."""
    admin = api.login()
    member = api.member(admin, "tn-m", "mia")
    group_id, _, task_id = process_node_service(api, member)
    for strategy in ("rolling", "recreate"):
        code, answer = put_update(
            api, member, group_id, command=["/bin/sh", "-c", "id"], strategy=strategy
        )
        assert code == 400, answer
        err = answer["error"]
        assert err["field"] == "command" and "process runtime" in err["message"], err
    # the create says the same of the same task
    r = api.client.post(
        "/api/v1/task-groups?dry_run=true",
        json=service_body(name="other", task={"command": ["/bin/sh", "-c", "id"]}),
        headers=member,
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.command", r.text
    g = group(api, member, group_id)
    assert (g["current_generation"], g["rolling_update_state"]) == (1, None)
    assert [t["id"] for t in g["tasks"]] == [task_id]
    assert rollout_events(api, member, group_id) == []
    # what it can run is still an update
    code, g = put_update(api, member, group_id, engine_args=["-c", "512"])
    assert code == 200 and g["rolling_update_state"] == "rolling", g


@pytest.mark.feature("J1")
def test_an_update_that_makes_no_progress_fails_with_the_reason_and_lets_go(api: Api) -> None:
    """A new replica only an offline Docker node could run stays pending: at the progress
    deadline the update fails with the scheduler's reason, rolls back, and the next
    update is accepted (issue 26)."""
    admin = api.login()
    member = api.member(admin, "tn-m", "mia")
    group_id, _, old = process_node_service(api, member)
    api.heartbeat("docker-node", memory_mb=0)  # registered, so the update is accepted
    api.app.rollouts.policy = replace(api.app.rollouts.policy, progress_deadline_s=30)

    def round_(advance_s: float = 0.0) -> None:
        api.clock.advance(advance_s)
        api.heartbeat("proc-node", runtime="process")  # the Docker node stays silent
        api.app.rollouts.drive_round()
        api.app.scheduler.run_round()

    code, _ = put_update(api, member, group_id, command=["python3", "serve.py"])
    assert code == 200
    round_()
    (c,) = candidates(api, member, group_id)
    assert c["status"] == "pending" and "process runtime" in c["status_message"], c
    round_(29)
    assert state(api, member, group_id)[0] == "rolling"
    round_(1)
    st, message = state(api, member, group_id)
    assert st == "rolling_back" and "no progress for 30 s" in message, message
    round_()
    st, message = state(api, member, group_id)
    assert st == "failed", message
    assert "no progress for 30 s" in message and "process runtime" in message
    assert "rolled back: generation 1 serves" in message
    assert task(api, member, c["id"])["status"] == "stopped"
    g = group(api, member, group_id)
    assert [t["id"] for t in g["tasks"]] == [old] and g["status"] == "running"
    assert rollout_events(api, member, group_id)[-1]["kind"] == "rollout.failed"
    # the lock is released: the next update is accepted
    code, g = put_update(api, member, group_id, engine_args=["-c", "512"])
    assert code == 200 and g["current_generation"] == 3, g


@pytest.mark.feature("D5", "J1")
def test_a_new_replica_that_loads_for_longer_than_the_ready_timeout_is_waited_for(
    api: Api,
) -> None:
    """The agent's load notes (D5: 'loading' when its window opens, then 'progress') reach
    the rollout through the task: a big model loading with progress is not late."""
    admin = api.login()
    group_id, node_id, (old0, _) = two_replicas(api, admin)
    policy = api.app.rollouts.policy
    assert put_update(api, admin, group_id, image=NEW_IMAGE)[0] == 200
    drive(api)
    api.app.scheduler.run_round()
    (c,) = candidates(api, admin, group_id)
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{c['id']}/claim", {}).status_code == 200
    note = {"status": "starting", "message": "loading a 40 GB model: expected ~7 min",
            "note": "loading"}
    assert report(api, node_id, c["id"], note).status_code == 200
    waited = 0.0
    while waited < policy.ready_timeout_s + 60:  # longer than the fixed limit
        drive(api, 10)
        waited += 10
        progress = {"status": "starting", "message": f"loading: {waited / 10:.0f} of 40 GB",
                    "note": "progress"}
        assert report(api, node_id, c["id"], progress).status_code == 200
    drive(api)
    st, message = state(api, admin, group_id)
    assert st == "rolling" and "attempt 1 of 4" in message, message
    assert f"{c['id']}: loading: " in message
    assert task(api, admin, c["id"])["status"] == "starting"
    # the agent goes quiet (its node is lost): past load_news_s the candidate is late
    drive(api, policy.load_news_s)
    st, message = state(api, admin, group_id)
    assert "attempt 1 of 4 failed" in message and "said nothing of it for" in message, message
    assert task(api, admin, old0)["status"] == "running"


# --- recreate pre-pulls the new image on the old replicas' nodes (J2, H7) ---


def prepull_asks(api: Api, node_id: str) -> list[dict[str, Any]]:
    r = api.client.get("/api/v1/agent/prepulls", headers={
        "Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node_id,
    })
    assert r.status_code == 200, r.text
    return list(r.json())


def answer(api: Api, node_id: str, task_id: str, outcome: str, message: str = "",
           image: str = NEW_IMAGE) -> Any:
    return api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/prepull",
                          {"image": image, "outcome": outcome, "message": message})


def prepull_all(api: Api, node_id: str, olds: list[str]) -> None:
    """As the node's agent does: the server asks, it pulls and says so; two rounds."""
    drive(api)
    asked = prepull_asks(api, node_id)
    assert sorted(a["task_id"] for a in asked) == sorted(olds)
    for a in asked:
        assert a["image"] == NEW_IMAGE
        assert answer(api, node_id, a["task_id"], "pulled").status_code == 200
    assert prepull_asks(api, node_id) == []  # answered for good: not asked again
    drive(api)


@pytest.mark.feature("J2", "H7")
def test_recreate_pulls_the_new_image_on_the_old_nodes_before_anything_stops(
    api: Api,
) -> None:
    admin = api.login()
    group_id, node_id, olds = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE, strategy="recreate")[0] == 200
    drive(api)
    st, message = state(api, admin, group_id)
    assert st == "recreating" and "being pulled on the old replicas' nodes" in message
    asked = prepull_asks(api, node_id)
    assert {a["task_id"] for a in asked} == set(olds) and asked[0]["registry_auth"] is None
    # a pull that may heal: noted, asked again; nothing stops meanwhile
    assert answer(api, node_id, olds[0], "failed", "image pull failed (timeout)").status_code \
        == 200
    assert answer(api, node_id, olds[1], "pulled").status_code == 200
    drive(api, 5)
    assert "last failure on" in state(api, admin, group_id)[1]
    assert [a["task_id"] for a in prepull_asks(api, node_id)] == [olds[0]]
    assert all(task(api, admin, o)["draining"] is False for o in olds)
    assert answer(api, node_id, olds[0], "pulled").status_code == 200
    drive(api)
    assert "present on the nodes of every old replica (2)" in state(api, admin, group_id)[1]
    drive(api)  # now the old generation drains, as before
    assert all(task(api, admin, o)["draining"] for o in olds)
    # an answer nobody asks for any more, or for another image, is refused
    assert answer(api, node_id, olds[0], "pulled").status_code == 409
    assert answer(api, "node-elsewhere", olds[0], "pulled").status_code in (401, 403, 404)


@pytest.mark.feature("J2", "H7")
def test_recreate_to_an_image_no_node_can_pull_fails_with_the_old_generation_serving(
    api: Api,
) -> None:
    admin = api.login()
    group_id, node_id, olds = two_replicas(api, admin)
    assert put_update(api, admin, group_id, image=NEW_IMAGE, strategy="recreate")[0] == 200
    drive(api)
    why = f"image pull failed (not found): {NEW_IMAGE}; manifest unknown"
    assert answer(api, node_id, olds[0], "unavailable", why).status_code == 200
    drive(api)
    st, message = state(api, admin, group_id)
    assert st == "failed" and "cannot be pulled" in message and "not found" in message
    assert "nothing was stopped" in message
    for o in olds:
        t = task(api, admin, o)
        assert (t["status"], t["draining"], t["replaced_by"]) == ("running", False, "")
    assert candidates(api, admin, group_id) == []
    assert prepull_asks(api, node_id) == []  # the update is over: nothing asked
    kinds = [e["kind"] for e in events(api, admin, group_id)]
    assert "rollout.prepull" in kinds and kinds[-1] == "rollout.failed"
