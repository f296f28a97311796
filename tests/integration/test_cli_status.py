"""The management CLI against a real server on a real socket: `status` exit codes, tables,
`--json`. The server is the in-process one (real database, real ASGI app) served by
uvicorn in a thread; the test moves its state with the API and its fake clock."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from heteroflow import cli
from heteroflow.cmd.remote import save_login
from heteroflow.serving import bind, http_server
from tests.conftest import free_port

from .conftest import ADMIN_PASSWORD, Api, service_body


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite only: what is tested here is the CLI, not the database."""
    return f"sqlite:///{tmp_path / 'hf.db'}"


@pytest.fixture
def served(api: Api) -> Iterator[str]:
    """The API on 127.0.0.1:<ephemeral port>; its URL."""
    server = http_server(api.app.asgi, lifespan="off")
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def logged_in(
    served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path / "cli"))
    assert cli.main(["login", "--server", served, "--password", ADMIN_PASSWORD]) == 0
    capsys.readouterr()
    return served


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def running_service(api: Api) -> tuple[str, str, str]:
    """An elected leader, one online node and one service running on it: ids."""
    api.app.leadership.reconcile_once(api.clock.now())
    admin = api.login()
    node_id = api.heartbeat("node-a")
    r = api.client.post("/api/v1/task-groups", json=service_body(name="chat"), headers=admin)
    assert r.status_code == 201, r.text
    group_id, task_id = r.json()["id"], r.json()["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text
    return node_id, group_id, task_id


def test_status_is_0_when_healthy_and_1_with_a_failed_service(
    api: Api, logged_in: str, capsys: pytest.CaptureFixture[str]
) -> None:
    node_id, group_id, task_id = running_service(api)
    code, out, err = run(capsys, "status")
    assert (code, err) == (0, ""), out
    assert f"server:   {logged_in}  reachable, health ok" in out
    assert "nodes:    1 online, 0 offline" in out and "services: 1: 1 running" in out
    assert "leader srv-" in out and out.rstrip().endswith("nothing is wrong")

    r = api.agent_post(
        node_id,
        f"/api/v1/agent/tasks/{task_id}/report",
        {"status": "failed", "message": "engine exited with code 1"},
    )
    assert r.status_code == 200, r.text
    code, out, _ = run(capsys, "status")
    assert code == 1
    problems = out.split("what is wrong (1):")[1]
    assert "service failed" in problems and f"chat ({group_id})" in problems
    assert "engine exited with code 1" in problems
    code, out, _ = run(capsys, "status", "--json")
    summary = json.loads(out)
    assert code == 1 and summary["ok"] is False
    assert [p["kind"] for p in summary["problems"]] == ["service_failed"]
    assert summary["services"]["by_status"] == {"failed": 1}


def test_status_is_1_with_an_offline_node_or_a_pending_task(
    api: Api, logged_in: str, capsys: pytest.CaptureFixture[str]
) -> None:
    running_service(api)
    api.heartbeat("node-b")
    api.clock.advance(api.app.settings.node_offline_after_s / 2 + 1)
    api.heartbeat("node-a")  # still beating; node-b went quiet
    api.clock.advance(api.app.settings.node_offline_after_s / 2 + 1)
    api.app.leadership.reconcile_once(api.clock.now())  # the lease stays held
    code, out, _ = run(capsys, "status")
    assert code == 1, out
    assert "nodes:    1 online, 1 offline" in out
    problems = out.split("what is wrong (1):")[1].split()
    assert problems[:4] == ["PROBLEM", "WHAT", "REASON", "node"] and "node-b" in problems

    admin = api.login()
    big = service_body(name="big", task={"gpu_required": 4})
    assert api.client.post("/api/v1/task-groups", json=big, headers=admin).status_code == 201
    api.app.scheduler.run_round()
    summary = json.loads(run(capsys, "status", "--json")[1])
    pending = [p for p in summary["problems"] if p["kind"] == "task_pending"]
    assert len(pending) == 1 and "big (tg-" in pending[0]["subject"]
    assert pending[0]["reason"]  # the scheduler's reason, first line


def test_status_is_2_when_the_server_cannot_be_reached(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path / "cli"))
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    save_login(nowhere, "some-token")
    code, out, err = run(capsys, "status")
    assert (code, out) == (2, "")
    assert err.startswith(f"heteroflow status: cannot reach the server at {nowhere}: ")
    assert err.count("\n") == 1  # one line, no traceback


def test_status_is_2_when_not_logged_in_or_the_token_is_refused(
    api: Api,
    served: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path / "cli"))
    code, _, err = run(capsys, "status")
    assert code == 2 and "heteroflow login" in err
    save_login(served, "not-a-token")
    code, _, err = run(capsys, "status")
    assert code == 2 and "error 401" in err and "heteroflow login" in err


def test_nodes_json_is_the_api_json_and_tables_show_what_runs(
    api: Api, logged_in: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, group_id, task_id = running_service(api)
    admin = api.login()
    code, out, _ = run(capsys, "nodes", "--json")
    assert code == 0
    assert json.loads(out) == api.client.get("/api/v1/nodes", headers=admin).json()
    code, out, _ = run(capsys, "services", "list", "--json")
    assert json.loads(out) == api.client.get("/api/v1/task-groups", headers=admin).json()

    code, out, _ = run(capsys, "services", "list")
    header, row = out.splitlines()
    assert header.split() == ["ID", "NAME", "MODEL", "STATUS", "REPLICAS", "ENDPOINT", "REASON"]
    assert row.split()[:5] == [group_id, "chat", "chat", "running", "1/1"]
    assert row.index("running") == header.index("STATUS")

    code, out, _ = run(capsys, "nodes")
    header, row = out.splitlines()
    assert row.split()[:4] == ["node-a", "online", "docker", "-"]

    code, out, _ = run(capsys, "services", "show", group_id)
    assert code == 0 and f"id:       {group_id}" in out and task_id in out
    code, out, _ = run(capsys, "tasks", "show", task_id)
    assert code == 0 and "status:     running" in out and "node:       " in out

    code, out, _ = run(capsys, "users", "list")
    assert out.splitlines()[1].split()[1:3] == ["admin", "operator"]
    code, out, _ = run(capsys, "tenants", "list")
    assert out.splitlines()[0].split() == ["ID", "NAME", "PRIORITY", "CEILING", "SHARING", "GROUP"]


def test_tasks_stop_and_services_delete_wait_until_the_agent_confirms(
    api: Api, logged_in: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    node_id, group_id, task_id = running_service(api)
    # the agent confirms the stop when the CLI's first poll has seen "stopping"
    real_sleep = time.sleep

    def agent_confirms(seconds: float) -> None:
        api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "stopped"})
        real_sleep(0.01)

    monkeypatch.setattr("heteroflow.cmd.waiting.time.sleep", agent_confirms)
    code, out, _ = run(capsys, "tasks", "stop", task_id, "--wait", "--timeout", "30")
    assert code == 0, out
    assert out.splitlines()[0] == f"stopping {task_id} (now stopping)"
    assert out.splitlines()[-1] == f"task {task_id} has stopped"
    assert "] stopped" in out

    code, out, _ = run(capsys, "services", "delete", group_id, "--wait", "--timeout", "30")
    assert code == 0 and out.splitlines()[-1] == f"every task of {group_id} has stopped"
    code, _, err = run(capsys, "services", "show", group_id)
    assert code == 1 and "error 404" in err
