"""Task logs over the API (C6): agents append, users page and follow; both databases."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from .conftest import Api, service_body

pytestmark = pytest.mark.feature("C6")
MiB = 1024 * 1024


def claimed_task(api: Api, admin: dict[str, str], node_id: str, name: str = "svc") -> str:
    g = api.client.post("/api/v1/task-groups", json=service_body(name=name), headers=admin)
    assert g.status_code == 201, g.text
    task_id = str(g.json()["tasks"][0]["id"])
    api.app.scheduler.run_round()
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    return task_id


def ship(api: Api, node_id: str, task_id: str, text: str) -> int:
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/logs", {"text": text})
    assert r.status_code == 201, r.text
    return int(r.json()["seq"])


def test_logs_are_appended_and_read_incrementally(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    url = f"/api/v1/tasks/{task_id}/logs"
    assert api.client.get(url, headers=admin).json() == {"chunks": [], "next": 0}
    assert ship(api, node_id, task_id, "loading model\n") == 1
    assert ship(api, node_id, task_id, "listening on :8080\n") == 2
    page = api.client.get(url, headers=admin).json()
    assert [c["text"] for c in page["chunks"]] == ["loading model\n", "listening on :8080\n"]
    assert [c["seq"] for c in page["chunks"]] == [1, 2] and page["next"] == 2
    assert ship(api, node_id, task_id, "request 1\n") == 3
    page = api.client.get(url, params={"after": page["next"]}, headers=admin).json()
    assert [c["text"] for c in page["chunks"]] == ["request 1\n"] and page["next"] == 3
    assert api.client.get(url, params={"after": 3}, headers=admin).json() == {
        "chunks": [],
        "next": 3,
    }
    one = api.client.get(url, params={"limit": 1}, headers=admin).json()
    assert [c["seq"] for c in one["chunks"]] == [1] and one["next"] == 1
    # an empty append stores nothing
    assert ship(api, node_id, task_id, "") == 0
    assert api.client.get(url, params={"after": 3}, headers=admin).json()["chunks"] == []


def test_other_tenants_and_other_nodes_get_404(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    ship(api, node_id, task_id, "secret output\n")
    other = api.member(admin, "team-b", "bob")
    r = api.client.get(f"/api/v1/tasks/{task_id}/logs", headers=other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = api.client.get(f"/api/v1/tasks/{task_id}/logs?follow=true", headers=other)
    assert r.status_code == 404
    assert api.client.get("/api/v1/tasks/task-000000000000/logs", headers=admin).status_code == 404
    other_node = api.heartbeat(name="node-b")
    r = api.agent_post(other_node, f"/api/v1/agent/tasks/{task_id}/logs", {"text": "x"})
    assert r.status_code == 404
    assert api.client.get(f"/api/v1/tasks/{task_id}/logs").status_code == 401
    r = api.client.post(f"/api/v1/agent/tasks/{task_id}/logs", json={"text": "x"})
    assert r.status_code == 401


def test_one_call_carries_at_most_one_mib(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    path = f"/api/v1/agent/tasks/{task_id}/logs"
    assert api.agent_post(node_id, path, {"text": "é" * (MiB // 2)}).status_code == 201
    r = api.agent_post(node_id, path, {"text": "é" * (MiB // 2) + "x"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert r.json()["error"]["field"] == "text"
    # a body far over the limit is refused before it is parsed
    r = api.agent_post(node_id, path, {"text": "x" * (7 * MiB)})
    assert r.status_code == 413
    r = api.agent_post(node_id, path, {"txt": "x"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "txt"


def test_the_oldest_chunks_are_trimmed_past_the_cap(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    api.app.settings.task_log_max_bytes = 10
    for text in ("aaaa", "bbbb", "cccc", "dddd"):
        ship(api, node_id, task_id, text)
    page = api.client.get(f"/api/v1/tasks/{task_id}/logs", headers=admin).json()
    assert [c["seq"] for c in page["chunks"]] == [3, 4]
    ship(api, node_id, task_id, "e" * 50)  # a chunk over the cap alone is still kept
    page = api.client.get(f"/api/v1/tasks/{task_id}/logs", headers=admin).json()
    assert [c["seq"] for c in page["chunks"]] == [5]
    assert ship(api, node_id, task_id, "f") == 6  # numbering goes on


def test_follow_streams_new_output_until_the_task_ends(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    api.app.settings.log_follow_poll_s = 0.02
    api.app.settings.log_follow_timeout_s = 30
    ship(api, node_id, task_id, "first\n")

    def agent() -> None:
        time.sleep(0.2)
        ship(api, node_id, task_id, "second\n")
        time.sleep(0.1)
        api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "failed"})

    t = threading.Thread(target=agent)
    t.start()
    r = api.client.get(
        f"/api/v1/tasks/{task_id}/logs", params={"follow": "true", "after": 0}, headers=admin
    )
    t.join()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "first\nsecond\n"
    # an ended task: what is there, then the stream ends at once
    r = api.client.get(
        f"/api/v1/tasks/{task_id}/logs", params={"follow": "true", "after": 1}, headers=admin
    )
    assert r.text == "second\n"


def test_follow_ends_after_its_timeout(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    api.app.settings.log_follow_poll_s = 0.01
    api.app.settings.log_follow_timeout_s = 0.05
    ship(api, node_id, task_id, "still running\n")
    r = api.client.get(f"/api/v1/tasks/{task_id}/logs?follow=true", headers=admin)
    assert r.text == "still running\n"


def test_cli_prints_logs_and_follows_until_the_end(
    api: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from heteroflow.cmd import remote, remote_tasks

    admin = api.login()
    node_id = api.heartbeat()
    task_id = claimed_task(api, admin, node_id)
    for text in ("one\n", "two\n"):
        ship(api, node_id, task_id, text)
    api.client.headers.update(admin)
    monkeypatch.setattr(remote, "_client", lambda server=None: _Shared(api.client))
    remote_tasks.logs(task_id)
    assert capsys.readouterr().out == "one\ntwo\n"
    api.app.settings.log_follow_poll_s = 0.01
    ship(api, node_id, task_id, "three\n")
    api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "failed"})
    remote_tasks.logs(task_id, follow=True)
    assert capsys.readouterr().out == "one\ntwo\nthree\n"
    with pytest.raises(remote.CliError, match="404"):
        remote_tasks.logs("task-000000000000", follow=True)


class _Shared:
    """The test's client as the CLI's: entering and leaving it leaves it open."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __enter__(self) -> Any:
        return self._client

    def __exit__(self, *_: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
