"""File requests end to end (C7): API, the agent protocol and the agent's serving code.

The agent side runs for real (``serve_file_requests`` with the real ``ServerClient``)
against the in-process app over ``httpx.ASGITransport``; files live in tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent.client import ServerClient
from heteroflow.agent.file_requests import process_roots, serve_file_requests
from heteroflow.models.tiny_gguf import write_tiny_gguf

from .conftest import NODE_TOKEN, Api, service_body

pytestmark = pytest.mark.feature("C7")


def placed_task(api: Api, admin: dict[str, str], model: Path, node_id: str) -> str:
    body = service_body(task={"model_path": str(model)})
    g = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert g.status_code == 201, g.text
    task_id = str(g.json()["tasks"][0]["id"])
    api.app.scheduler.run_round()
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    return task_id


@pytest.fixture
def models(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    write_tiny_gguf(d / "tiny.gguf")  # a real GGUF: create refuses one no engine loads
    (d / "sub").mkdir()
    (d / "README.md").write_text("hello")
    return d


def agent_client(api: Api, node_id: str) -> ServerClient:
    client = ServerClient("http://server", NODE_TOKEN, 10)
    client._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api.app.asgi.api),
        base_url="http://server",
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    client.node_id = node_id
    return client


def request(api: Api, who: dict[str, str], task_id: str, kind: str, path: str) -> Any:
    return api.client.post(
        "/api/v1/file-requests",
        json={"task_id": task_id, "request_type": kind, "target_path": path},
        headers=who,
    )


async def serve(api: Api, node_id: str, models: Path, chunk_bytes: int = 1000) -> int:
    client = agent_client(api, node_id)
    try:
        return await serve_file_requests(
            client,
            lambda _task: process_roots(str(models / "tiny.gguf"), (str(models),), ()),
            chunk_bytes,
        )
    finally:
        await client.aclose()


async def test_list_and_download_through_the_agent(api: Api, models: Path) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    listing = request(api, admin, task_id, "list", str(models))
    assert listing.status_code == 201, listing.text
    assert listing.json()["status"] == "pending" and listing.json()["id"].startswith("fr-")
    download = request(api, admin, task_id, "download", str(models / "tiny.gguf")).json()
    early = api.client.get(f"/api/v1/file-requests/{download['id']}/content", headers=admin)
    assert early.status_code == 409

    assert await serve(api, node_id, models) == 2

    got = api.client.get(f"/api/v1/file-requests/{listing.json()['id']}", headers=admin).json()
    assert got["status"] == "done" and got["error"] == ""
    entries = {e["name"]: e for e in got["entries"]}
    assert set(entries) == {"tiny.gguf", "sub", "README.md"}
    size = (models / "tiny.gguf").stat().st_size
    assert entries["tiny.gguf"]["size"] == size and not entries["tiny.gguf"]["is_dir"]
    assert entries["sub"]["is_dir"] and entries["README.md"]["mtime"] > 0
    got = api.client.get(f"/api/v1/file-requests/{download['id']}", headers=admin).json()
    assert got["status"] == "done" and got["size_bytes"] == size
    r = api.client.get(f"/api/v1/file-requests/{download['id']}/content", headers=admin)
    assert r.status_code == 200
    assert r.content == (models / "tiny.gguf").read_bytes()
    assert r.headers["content-length"] == str(size)
    assert "tiny.gguf" in r.headers["content-disposition"]
    r = api.client.get(f"/api/v1/file-requests/{listing.json()['id']}/content", headers=admin)
    assert r.status_code == 409


async def test_an_empty_file_downloads_as_empty(api: Api, models: Path) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    (models / "empty").write_bytes(b"")
    fr = request(api, admin, task_id, "download", str(models / "empty")).json()
    await serve(api, node_id, models)
    r = api.client.get(f"/api/v1/file-requests/{fr['id']}/content", headers=admin)
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize(
    "path",
    [
        "relative/tiny.gguf",
        "{models}/../secret",
        "{models}2/x",
        "/etc/passwd",
        "{models}/a\x00b",
        "/" + "a" * 4096,
    ],
)
def test_paths_outside_or_malformed_are_refused_with_400(api: Api, models: Path, path: str) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    r = request(api, admin, task_id, "list", path.format(models=models))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "target_path"
    bad_type = api.client.post(
        "/api/v1/file-requests",
        json={"task_id": task_id, "request_type": "delete", "target_path": str(models)},
        headers=admin,
    )
    assert bad_type.status_code == 400 and bad_type.json()["error"]["field"] == "request_type"


async def test_the_agent_refuses_a_symlink_that_leads_out(
    api: Api, models: Path, tmp_path: Path
) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    (tmp_path / "secret").write_text("private key")
    os.symlink(tmp_path / "secret", models / "innocent.txt")
    fr = request(api, admin, task_id, "download", str(models / "innocent.txt"))
    assert fr.status_code == 201  # lexically inside: only the node can see the link
    missing = request(api, admin, task_id, "download", str(models / "nope")).json()
    await serve(api, node_id, models)
    got = api.client.get(f"/api/v1/file-requests/{fr.json()['id']}", headers=admin).json()
    assert got["status"] == "failed" and "outside the task's directories" in got["error"]
    r = api.client.get(f"/api/v1/file-requests/{fr.json()['id']}/content", headers=admin)
    assert r.status_code == 409
    got = api.client.get(f"/api/v1/file-requests/{missing['id']}", headers=admin).json()
    assert got["status"] == "failed" and "No such file" in got["error"]


def test_a_request_is_claimed_once_and_only_by_its_node(api: Api, models: Path) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    other = api.heartbeat(name="node-b", runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    fr = request(api, admin, task_id, "list", str(models)).json()
    headers = {"Authorization": f"Bearer {NODE_TOKEN}"}
    r = api.client.get(
        "/api/v1/agent/file-requests", headers={**headers, "X-Heteroflow-Node": other}
    )
    assert r.json() == []
    first = api.client.get(
        "/api/v1/agent/file-requests", headers={**headers, "X-Heteroflow-Node": node_id}
    )
    second = api.client.get(
        "/api/v1/agent/file-requests", headers={**headers, "X-Heteroflow-Node": node_id}
    )
    assert [x["id"] for x in first.json()] == [fr["id"]] and second.json() == []
    got = api.client.get(f"/api/v1/file-requests/{fr['id']}", headers=admin).json()
    assert got["status"] == "running"
    # another node cannot upload to it or finish it
    r = api.agent_post(other, f"/api/v1/agent/file-requests/{fr['id']}/done", {"status": "done"})
    assert r.status_code == 404
    done = {"status": "done", "result": {"entries": []}}
    path = f"/api/v1/agent/file-requests/{fr['id']}/done"
    assert api.agent_post(node_id, path, done).status_code == 200
    assert api.agent_post(node_id, path, done).status_code == 409  # finished once


def test_uploads_are_checked_chunk_by_chunk_and_at_the_end(api: Api, models: Path) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    fr = request(api, admin, task_id, "download", str(models / "tiny.gguf")).json()
    headers = {"Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node_id}
    api.client.get("/api/v1/agent/file-requests", headers=headers)
    api.app.settings.file_chunk_bytes = 10
    chunk = f"/api/v1/agent/file-requests/{fr['id']}/chunks"
    r = api.client.post(chunk, content=b"x" * 11, headers={**headers, "X-Chunk-Seq": "0"})
    assert r.status_code == 413
    r = api.client.post(chunk, content=b"x" * 10, headers={**headers, "X-Chunk-Seq": "-1"})
    assert r.status_code == 400
    for _ in range(2):  # a resent chunk replaces itself
        r = api.client.post(chunk, content=b"y" * 10, headers={**headers, "X-Chunk-Seq": "0"})
        assert r.status_code == 200 and r.json() == {"received_bytes": 10}
    r = api.agent_post(
        node_id,
        f"/api/v1/agent/file-requests/{fr['id']}/done",
        {"status": "done", "size_bytes": 2500},
    )
    assert r.json()["status"] == "failed"
    got = api.client.get(f"/api/v1/file-requests/{fr['id']}", headers=admin).json()
    assert got["status"] == "failed" and "upload incomplete" in got["error"]


def test_visibility_placement_and_expiry(api: Api, models: Path) -> None:
    admin = api.login()
    node_id = api.heartbeat(runtime="process")
    task_id = placed_task(api, admin, models / "tiny.gguf", node_id)
    fr = request(api, admin, task_id, "list", str(models)).json()
    other = api.member(admin, "team-b", "bob")
    assert request(api, other, task_id, "list", str(models)).status_code == 404
    assert api.client.get(f"/api/v1/file-requests/{fr['id']}", headers=other).status_code == 404
    r = api.client.get(f"/api/v1/file-requests/{fr['id']}/content", headers=other)
    assert r.status_code == 404
    # a task that is not placed on a node has nobody to serve it
    g = api.client.post(
        "/api/v1/task-groups", json=service_body(name="later"), headers=admin
    ).json()
    pending = request(api, admin, g["tasks"][0]["id"], "list", "/models")
    assert pending.status_code == 409
    # nobody picked the request up in time: it fails with the reason
    api.clock.advance(api.app.settings.file_request_timeout_s + 1)
    got = api.client.get(f"/api/v1/file-requests/{fr['id']}", headers=admin).json()
    assert got["status"] == "failed" and "no progress" in got["error"]
