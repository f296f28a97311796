"""Stop / start / restart a whole service (issue 13 item 2): the owner's ``desired``
state, through the state door; the recovery loop leaves a stopped service alone; a start
gives every ended rank a fresh task (count 0) with the same endpoint and key."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from heteroflow import cli
from heteroflow.serving import bind, http_server

from .conftest import ADMIN_PASSWORD, Api, service_body
from .test_fault_events import create, events, report, start
from .test_recovery import current, fail, group, recovery_round, run_and_fail, task


def post(
    api: Api, headers: dict[str, str], group_id: str, action: str
) -> tuple[int, dict[str, Any]]:
    r = api.client.post(f"/api/v1/task-groups/{group_id}/{action}", headers=headers)
    return r.status_code, r.json() if r.content else {}


def test_stop_moves_every_task_through_the_door_and_recovery_leaves_it(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, first = create(api, admin, service_body(enable_api=True))
    api.app.scheduler.run_round()
    start(api, node_id, first)

    code, g = post(api, admin, group_id, "stop")
    assert code == 200, g
    assert g["desired"] == "stopped" and g["status"] == "stopping"
    assert g["tasks"][0]["status"] == "stopping"
    assert report(api, node_id, first, {"status": "stopped"}).status_code == 200
    assert group(api, admin, group_id)["status"] == "stopped"
    assert recovery_round(api).rebuilt == []
    code, again = post(api, admin, group_id, "stop")  # idempotent
    assert code == 200 and again["status"] == "stopped"
    desired = [e for e in events(api, admin, group_id) if e["kind"] == "group.desired"]
    assert [(e["from_status"], e["to_status"]) for e in desired] == [("running", "stopped")]
    assert desired[0]["message"] == "stopped by admin"


def test_start_gives_each_ended_rank_a_fresh_task_with_the_same_key(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(enable_api=True), headers=admin)
    created = r.json()
    group_id, first, endpoint = created["id"], created["tasks"][0]["id"], created["endpoint"]
    api.app.scheduler.run_round()
    start(api, node_id, first)

    code, g = post(api, admin, group_id, "start")
    assert code == 409, g  # already running
    assert "already running" in g["error"]["message"]

    assert post(api, admin, group_id, "stop")[0] == 200
    assert report(api, node_id, first, {"status": "stopped"}).status_code == 200
    code, g = post(api, admin, group_id, "start")
    assert code == 200, g
    assert g["desired"] == "running" and g["status"] == "pending" and g["endpoint"] == endpoint
    (new,) = g["tasks"]
    assert new["id"] != first and new["rank"] == 0 and new["rebuild_count"] == 0
    assert task(api, admin, first)["replaced_by"] == new["id"]
    api.app.scheduler.run_round()
    start(api, node_id, new["id"])
    assert group(api, admin, group_id)["status"] == "running"


def test_a_start_after_the_loop_gave_up_starts_the_count_again(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, _ = create(api, admin, service_body())
    for _ in range(5):
        run_and_fail(api, admin, node_id, group_id, ran_s=1)
        recovery_round(api)
    last = run_and_fail(api, admin, node_id, group_id, ran_s=1)
    assert recovery_round(api).gave_up == [last]
    code, g = post(api, admin, group_id, "start")  # failed, meant to run: not a 409
    assert code == 200, g
    assert g["tasks"][0]["rebuild_count"] == 0 and g["tasks"][0]["status"] == "pending"


def test_restart_while_stopping_replaces_the_stopping_tasks(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, first = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, first)
    assert post(api, admin, group_id, "stop")[0] == 200
    code, g = post(api, admin, group_id, "start")  # before the agent confirmed the stop
    assert code == 200 and g["tasks"][0]["id"] != first
    # the old engine's stop still lands on the old task; the new one is what counts
    assert report(api, node_id, first, {"status": "stopped"}).status_code == 200
    assert task(api, admin, first)["status"] == "stopped"
    assert group(api, admin, group_id)["status"] == "pending"


def test_stop_wins_over_a_failed_task_the_loop_would_rebuild(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, first = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, first)
    fail(api, node_id, first)
    assert post(api, admin, group_id, "stop")[0] == 200
    assert task(api, admin, first)["status"] == "stopped"
    assert recovery_round(api).rebuilt == []
    assert current(api, admin, group_id)["id"] == first


def test_start_stop_are_404_across_tenants_and_for_a_deleted_group(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    group_id, _ = create(api, admin, service_body())
    outsider = api.member(admin, "other", "mallory")
    for action in ("stop", "start"):
        assert post(api, outsider, group_id, action)[0] == 404
    r = api.client.patch(
        f"/api/v1/task-groups/{group_id}", json={"idle_timeout_minutes": 5}, headers=outsider
    )
    assert r.status_code == 404
    assert api.client.delete(f"/api/v1/task-groups/{group_id}", headers=admin).status_code == 204
    for action in ("stop", "start"):  # a deleted group is never started
        assert post(api, admin, group_id, action)[0] == 404
    assert post(api, admin, "tg-nope", "start")[0] == 404


# ---- the CLI: services stop / start / restart, against a real socket ---------------


@pytest.fixture
def logged_in(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[str]:
    server = http_server(api.app.asgi, lifespan="off")
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path / "cli"))
        assert cli.main(["login", "--server", url, "--password", ADMIN_PASSWORD]) == 0
        capsys.readouterr()
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the CLI is what is tested
def test_cli_stop_start_restart(
    api: Api, logged_in: str, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, first = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, first)

    assert cli.main(["services", "stop", group_id]) == 0
    assert f"stopping {group_id} (now stopping)" in capsys.readouterr().out
    assert report(api, node_id, first, {"status": "stopped"}).status_code == 200
    assert cli.main(["services", "stop", group_id, "--wait", "--timeout", "5"]) == 0
    assert f"service {group_id} is stopped" in capsys.readouterr().out

    assert cli.main(["services", "start", group_id]) == 0
    assert f"starting {group_id} (now pending)" in capsys.readouterr().out
    assert cli.main(["services", "start", group_id]) == 1  # already running
    assert "error 409" in capsys.readouterr().err

    second = current(api, admin, group_id)["id"]
    assert cli.main(["services", "restart", group_id]) == 0
    assert f"restarting {group_id}" in capsys.readouterr().out
    third = current(api, admin, group_id)
    assert third["id"] != second and third["status"] == "pending"
    assert task(api, admin, second)["status"] == "stopped"  # never placed: stopped at once
