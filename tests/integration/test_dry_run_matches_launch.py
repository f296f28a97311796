"""The dry run shows what the agent launches: a dry run over the API, then the same
group created and scheduled, and the agent's ``build_container`` for the assignment the
heartbeat reply carries — field by field the same container.

Only what a create assigns (task and group ids) and what only the agent knows (its work
dir, under which it writes engine config files) are placeholders in the dry run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.inventory import GpuCard
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.placement.dry_run import (
    PLANNED_CONFIG_DIR,
    PLANNED_GROUP_ID,
    PLANNED_ID,
    plan_read,
)

from .conftest import NODE_TOKEN, Api

ADDRESS = "10.0.0.7"  # what the node reports, and where its agent publishes ports


def card(i: int, vendor: str) -> dict[str, Any]:
    return {"index": i, "vendor": vendor, "model": "X", "memory_total_mb": 65536,
            "compute_capability": "9.0" if vendor == "nvidia" else None}


def heartbeat(api: Api, gpus: list[dict[str, Any]], engines: dict[str, str]) -> dict[str, Any]:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": "node-x",
            "address": ADDRESS,
            "runtime": "docker",
            "engines": engines,
            "allowed_volume_prefixes": [str(api.tmp)],
            "inventory": {"gpus": gpus, "cpu_count": 16, "memory_total_mb": 262144,
                          "memory_available_mb": 262144},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def masked(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        for placeholder, real in ids.items():
            value = value.replace(placeholder, real)
        return value
    if isinstance(value, dict):
        return {masked(k, ids): masked(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v, ids) for v in value]
    return value


HF_MODEL = "hf-model"  # a HuggingFace-style folder under the test's tmp dir


CASES = [
    pytest.param(
        "nvidia", {"vllm": "vllm/vllm-openai:v0.11.2"},
        {"parallelism": "tensor_parallel", "world_size": 2,
         "task": {"image": "vllm/vllm-openai:v0.11.2", "kv_offload_gb": 8}},
        "0.11.2", id="vllm-tp2-kv-offload",
    ),
    pytest.param(
        "nvidia", {"sglang": "lmsysorg/sglang:v0.5.5"},
        {"parallelism": "split", "world_size": 2,
         "task": {"image": "lmsysorg/sglang:v0.5.5", "gpu_required": 1,
                  "env": ["HF_HOME=/cache", "CUDA_VISIBLE_DEVICES=7"]}},
        "", id="sglang-split",
    ),
    pytest.param(
        "ascend", {"mindie": "ascendhub/mindie:2.2.rc1"},
        {"parallelism": "tensor_parallel", "world_size": 2,
         "task": {"image": "ascendhub/mindie:2.2.rc1", "engine": "mindie"}},
        "", id="mindie-tp2-config-file",
    ),
    pytest.param(
        "nvidia", {"vllm": "vllm/vllm-openai:v0.11.2"},
        # an image that names no engine: the node's chain picks one at placement (H1)
        {"task": {"image": "example.org/serving:1", "gpu_required": 1}},
        "", id="engine-chosen-by-the-node",
    ),
    pytest.param(
        None, {"llamacpp": "ghcr.io/ggml-org/llama.cpp:server"},
        {"task": {"image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0}},
        "", id="llamacpp-cpu",
    ),
    pytest.param(
        "nvidia", {"vllm": "vllm/vllm-openai:v0.11.2"},
        {"task_type": "container",
         "task": {"image": "busybox:1.36", "command": ["/bin/sh", "-c", "sleep 1"],
                  "gpu_required": 1, "ports": [{"container_port": 7000}]}},
        "", id="custom-command",
    ),
]


@pytest.mark.parametrize(("vendor", "engines", "body", "version"), CASES)
def test_the_agent_launches_what_the_dry_run_showed(
    api: Api, tmp_path: Path, vendor: str | None, engines: dict[str, str],
    body: dict[str, Any], version: str,
) -> None:
    admin = api.login()
    gpus = [card(i, vendor) for i in range(4)] if vendor else []
    heartbeat(api, gpus, engines)
    model_dir = tmp_path / HF_MODEL
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    task = dict(body.get("task", {}))
    if "command" not in task:
        task["model_path"] = str(gguf if vendor is None else model_dir)
    request = {"name": "svc", **body, "task": task}

    r = api.client.post("/api/v1/task-groups?dry_run=true", json=request, headers=admin)
    assert r.status_code == 200, r.text
    shown = r.json()["tasks"]
    assert all(t["container"] is not None for t in shown), shown

    g = api.client.post("/api/v1/task-groups", json=request, headers=admin)
    assert g.status_code == 201, g.text
    group = g.json()
    assert api.app.scheduler.run_round().placed == len(group["tasks"])
    reply = heartbeat(api, gpus, engines)
    assignments = {a["name"]: TaskAssignment.model_validate(a) for a in reply["tasks"]}
    assert len(assignments) == len(shown)

    config = NodeConfig.from_dict({"allowed_volume_prefixes": [str(tmp_path)]})
    cards = [GpuCard(c["index"], "", c["vendor"], c["model"], c["memory_total_mb"], 0,
                     c["compute_capability"], False, False, None, "declared") for c in gpus]
    work_dir = tmp_path / "agent"
    for planned in shown:
        name = planned["container"]["env"]["HETEROFLOW_TASK_NAME"]
        t = assignments[name]
        # the same placement: the round chose what the dry run predicted
        assert planned["placement"]["gpu_ids"] == t.gpu_ids
        assert planned["placement"]["host_ports"] == [p["host_port"] for p in t.ports]
        plan = build_container(t, config, address=ADDRESS, cards=cards, work_dir=work_dir,
                               engine_version=version)
        launched = plan_read(plan).model_dump(mode="json")
        config_dir = str(work_dir / "config")
        launched["config_files"] = [
            m["target"] for m in launched["mounts"] if m["source"].startswith(config_dir)
        ]
        want = masked(planned["container"], {
            PLANNED_CONFIG_DIR: config_dir, PLANNED_ID: t.id, PLANNED_GROUP_ID: t.group_id,
        })
        assert set(want) == set(launched)
        for field in want:
            assert want[field] == launched[field], field
        # C14: an engine's API port on the node's private loopback, behind its door
        api_port, *others = want["ports"]
        assert api_port["host_ip"] == (
            ENGINE_ADDRESS if t.task_type == "inference" else ADDRESS
        )
        assert {p["host_ip"] for p in others} <= {ADDRESS}
        assert want["labels"]["heteroflow.task"] == t.id
        assert want["security"]["cap_drop"] == ["ALL"]
        if t.engine == "mindie":
            assert want["config_files"] and all(
                (work_dir / "config" / t.id / f.lstrip("/")).is_file()
                for f in want["config_files"]
            )
