"""A GGUF the server can read and no engine could load is refused at create and dry run
(issue 33: an empty GGUF got 201, an endpoint and a key, then failed on its node with
"engine exited with code 1; last output:" and nothing after it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from heteroflow.db.tables import InferenceEndpoint, Task, TaskGroup
from heteroflow.models.tiny_gguf import write_tiny_gguf

from .conftest import NODE_TOKEN, Api, service_body


def beat(api: Api, allowed: Path) -> None:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "process",
              "allowed_volume_prefixes": [str(allowed)],
              "engines": {"llamacpp": ""},
              "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384,
                            "memory_available_mb": 16384}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text


def written(api: Api) -> list[int]:
    with api.app.db.session() as s:
        return [int(s.scalar(select(func.count()).select_from(t)) or 0)
                for t in (TaskGroup, Task, InferenceEndpoint)]


def body(path: Path) -> dict[str, Any]:
    return service_body(task={"model_path": str(path)})


@pytest.mark.feature("C4")
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "is empty (0 bytes)"),
        (b"PK\x03\x04 not a model at all, a zip", "not a little-endian GGUF"),
        (b"GGUF\x03\x00\x00\x00\x01", "truncated GGUF header"),
    ],
)
def test_a_gguf_no_engine_could_load_is_a_400_and_nothing_is_written(
    api: Api, tmp_path: Path, content: bytes, says: str
) -> None:
    admin = api.login()
    beat(api, tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    for dry in ("true", "false"):
        r = api.client.post(f"/api/v1/task-groups?dry_run={dry}", json=body(bad), headers=admin)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "task.model_path" and says in err["message"], err
    assert written(api) == [0, 0, 0]


def test_a_loadable_gguf_and_a_path_only_the_nodes_have_pass(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    beat(api, tmp_path)
    good = write_tiny_gguf(tmp_path / "good.gguf")
    r = api.client.post("/api/v1/task-groups", json=body(good), headers=admin)
    assert r.status_code == 201, r.text
    elsewhere = tmp_path / "on-the-nodes-only" / "m.gguf"  # the server has no such file
    r = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=service_body(name="other", task={
            "model_path": str(elsewhere)}), headers=admin,
    )
    assert r.status_code == 200, r.text


@pytest.mark.feature("C4")
def test_a_gguf_cut_short_after_its_header_is_a_400(api: Api, tmp_path: Path) -> None:
    """Its header reads, but the file holds fewer bytes than its tensors need (an
    interrupted download): llama.cpp would fail to load it on the node."""
    admin = api.login()
    beat(api, tmp_path)
    whole = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 1024])
    for dry in ("true", "false"):
        r = api.client.post(f"/api/v1/task-groups?dry_run={dry}", json=body(cut), headers=admin)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "task.model_path", err
        assert f"its tensors need {len(whole)} bytes" in err["message"], err
    assert written(api) == [0, 0, 0]
