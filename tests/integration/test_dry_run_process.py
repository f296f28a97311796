"""The dry run on a node whose runtime is ``process`` shows what that node's agent starts —
the argv and environment of ``core.process_recipe`` (the agent's ``build_launch`` calls the
same function) — not the container its image would run. Only what a create assigns (ids)
and what only the node knows (its Pythons) are placeholders."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.launch import build_launch
from heteroflow.core.engine_access import ENGINE_ADDRESS, KEY_ENV
from heteroflow.core.process_recipe import AGENT_PYTHON
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.placement.dry_run import PLANNED_GROUP_ID, PLANNED_ID

from .conftest import NODE_TOKEN, Api
from .test_dry_run_matches_launch import masked

IMAGE = "ghcr.io/ggml-org/llama.cpp:server"


def heartbeat(api: Api, tmp: Path) -> dict[str, Any]:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": "proc-node",
            "address": "10.0.0.9",
            "runtime": "process",
            "engines": {"llamacpp": ""},
            "allowed_volume_prefixes": [str(tmp)],
            "inventory": {"gpus": [], "cpu_count": 8, "memory_total_mb": 65536,
                          "memory_available_mb": 65536},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.feature("C5")
def test_a_dry_run_on_a_process_node_shows_the_argv_its_agent_starts(
    api: Api, tmp_path: Path
) -> None:
    admin = api.login()
    heartbeat(api, tmp_path)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    request = {"name": "svc", "task": {"image": IMAGE, "gpu_required": 0,
                                       "model_path": str(gguf), "engine_args": ["-c", "512"],
                                       "env": ["OMP_NUM_THREADS=1"]}}
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=request, headers=admin)
    assert r.status_code == 200, r.text
    (shown,) = r.json()["tasks"]
    c = shown["container"]
    assert c["runtime"] == "process" and c["entrypoint"] is None and c["mounts"] == []
    argv = c["command"]
    # not the image's container command: the agent's own launcher on its own Python
    assert argv[:3] == [AGENT_PYTHON, "-m", "heteroflow.engines.llamacpp_server"]
    assert argv[argv.index("-m", 1 + argv.index("-m")) + 1] == str(gguf)

    g = api.client.post("/api/v1/task-groups", json=request, headers=admin)
    assert g.status_code == 201, g.text
    assert api.app.scheduler.run_round().placed == 1
    (a,) = heartbeat(api, tmp_path)["tasks"]
    t = TaskAssignment.model_validate(a)
    assert shown["placement"]["host_ports"] == [p["host_port"] for p in t.ports]

    config = NodeConfig.from_dict({"allowed_volume_prefixes": [str(tmp_path)]})
    spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path / "logs",
                        host=ENGINE_ADDRESS)
    want = masked(c, {PLANNED_ID: t.id, PLANNED_GROUP_ID: t.group_id, AGENT_PYTHON:
                      sys.executable})
    assert list(spec.argv) == want["command"]
    launched_env = {k: v for k, v in spec.env.items() if k != KEY_ENV.get(t.engine)}
    assert launched_env == want["env"]
    assert want["ports"] == [{"container_port": t.ports[0]["container_port"],
                              "host_ip": ENGINE_ADDRESS, "host_port": spec.host_ports[0]}]
