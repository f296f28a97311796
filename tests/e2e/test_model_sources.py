"""A model that comes to the node (issue 29, H9): a service whose ``model_path`` is a URL
is fetched into the node's cache by the agent and served by the real llama.cpp engine.

The model is served by a web server the test starts on the loopback (``http://`` is
accepted to a loopback host only: core.model_sources), with a ``.sha256`` beside it as
``sha256sum`` writes it; the server counts the requests for the model's bytes, so "fetched
once however many tasks ask" is a count, not a guess.
"""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest

from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.conftest import free_port

from .conftest import Stack, wait_for

pytestmark = pytest.mark.e2e


class Files(http.server.SimpleHTTPRequestHandler):
    gets: list[str] = []

    def do_GET(self) -> None:
        Files.gets.append(self.path)
        super().do_GET()

    def log_message(self, *args: Any) -> None:
        pass


ROOTS: dict[str, Path] = {}


def web_root(url: str) -> Path:
    return ROOTS[url]


@pytest.fixture
def web(tmp_path: Path) -> Iterator[str]:
    root = tmp_path / "web"
    root.mkdir()
    model = write_tiny_gguf(root / "tiny-web.gguf")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    (root / "tiny-web.gguf.sha256").write_text(f"{digest}  tiny-web.gguf\n")
    port = free_port()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), partial(Files, directory=str(root))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Files.gets = []
    url = f"http://127.0.0.1:{port}"
    ROOTS[url] = root
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def body(name: str, model_path: str) -> dict[str, Any]:
    return {
        "name": name,
        "model_name": name,
        "task": {
            "image": "ghcr.io/ggml-org/llama.cpp:server",
            "gpu_required": 0,
            "model_path": model_path,
        },
    }


def model_gets() -> int:
    return sum(1 for p in Files.gets if p == "/tiny-web.gguf")


def events(stack: Stack, group_id: str) -> list[dict[str, Any]]:
    return list(stack.api("GET", f"/api/v1/task-groups/{group_id}/events").json())


@pytest.mark.feature("H9")
def test_a_url_model_is_fetched_once_into_the_node_cache_and_served(
    stack: Stack, web: str
) -> None:
    source = f"{web}/tiny-web.gguf"
    r = stack.api("POST", "/api/v1/task-groups", json=body("fetched", source))
    assert r.status_code == 201, r.text
    g = stack.wait_status(r.json()["id"], "running", timeout_s=90)
    task = stack.api("GET", f"/api/v1/tasks/{g['tasks'][0]['id']}").json()
    # the engine was given the cache's copy, not the URL
    cached = sorted((stack.tmp / "agent" / "models").glob("*/tiny-web.gguf"))
    assert len(cached) == 1 and str(cached[0]) in task["launch_argv"], task["launch_argv"]
    assert cached[0].read_bytes() == (web_root(web) / "tiny-web.gguf").read_bytes()
    said = [e["message"] for e in events(stack, g["id"]) if e["kind"] == "task.model_fetch"]
    assert said[0].startswith(f"fetching model {source} (") and "1 file(s)" in said[0], said
    assert said[-1].startswith(f"fetched model {source}: "), said
    assert model_gets() == 1

    client = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=r.json()["api_key"], max_retries=0,
        timeout=30,
    )

    def answers() -> str | None:
        try:
            got = client.chat.completions.create(
                model="fetched", messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
        except openai.APIStatusError as exc:
            if exc.status_code in (401, 503):
                return None
            raise
        return got.choices[0].message.content or ""

    assert wait_for(answers, 20, "the fetched model answering", 0.2) is not None

    # a second service of the same source: the node's copy, no second download
    r2 = stack.api("POST", "/api/v1/task-groups", json=body("fetched-again", source))
    assert r2.status_code == 201, r2.text
    g2 = stack.wait_status(r2.json()["id"], "running", timeout_s=60)
    assert model_gets() == 1
    assert not [e for e in events(stack, g2["id"]) if e["kind"] == "task.model_fetch"]
    for gid in (g["id"], g2["id"]):
        assert stack.api("DELETE", f"/api/v1/task-groups/{gid}").status_code == 204


@pytest.mark.feature("H9")
def test_a_source_that_is_gone_or_bad_fails_its_task_with_the_reason(
    stack: Stack, web: str
) -> None:
    # a URL is the tenant's: the control plane never contacts it (no probing of the
    # server's network), so a missing file is the node's to find — the task fails with why
    source = f"{web}/missing.gguf"
    dry = stack.api("POST", "/api/v1/task-groups?dry_run=true", json=body("gone", source))
    assert dry.status_code == 200, dry.text
    assert dry.json()["model_source"]["resolved"] is False
    r = stack.api("POST", "/api/v1/task-groups", json=body("gone", source))
    assert r.status_code == 201, r.text
    gone = r.json()["id"]

    def gone_failed() -> dict[str, Any] | None:
        t = stack.group(gone)["tasks"][0]
        return t if t["status"] == "failed" else None

    t = wait_for(gone_failed, 60, "the task failed")
    message = stack.api("GET", f"/api/v1/tasks/{t['id']}").json()["status_message"]
    assert f"model {source} not fetched (not_found)" in message, message
    assert stack.api("DELETE", f"/api/v1/task-groups/{gone}").status_code == 204
    # a file whose bytes do not match the checksum beside it: the node refuses it
    root = web_root(web)
    (root / "bad.gguf").write_bytes((root / "tiny-web.gguf").read_bytes())
    (root / "bad.gguf.sha256").write_text("0" * 64 + "  bad.gguf\n")
    source = f"{web}/bad.gguf"
    r = stack.api("POST", "/api/v1/task-groups", json=body("unfetched", source))
    assert r.status_code == 201, r.text
    gid = r.json()["id"]

    def failed() -> dict[str, Any] | None:
        t = stack.group(gid)["tasks"][0]
        return t if t["status"] == "failed" else None

    t = wait_for(failed, 60, "the task failed")
    message = stack.api("GET", f"/api/v1/tasks/{t['id']}").json()["status_message"]
    assert f"model {source} not fetched (checksum)" in message, message
    assert not list((stack.tmp / "agent" / "models").glob("*/bad.gguf"))  # nothing kept
    assert stack.api("DELETE", f"/api/v1/task-groups/{gid}").status_code == 204
