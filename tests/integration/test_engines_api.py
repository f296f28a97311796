"""Engine-facing API behaviour: kv offload rules, dry run, memory precheck, templates, argv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.db.tables import InferenceEndpoint, Task, TaskGroup
from heteroflow.models.tiny_gguf import write_tiny_gguf

from .conftest import NODE_TOKEN, Api, service_body

A10 = {
    "index": 0,
    "vendor": "nvidia",
    "model": "A10",
    "memory_total_mb": 24576,
    "compute_capability": "8.6",
}


def heartbeat(
    api: Api, name: str, gpus: list[dict[str, Any]], engines: dict[str, str], memory_mb: int = 65536
) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name,
            "address": "127.0.0.1",
            "runtime": "docker",
            "engines": engines,
            "allowed_volume_prefixes": ["/data/models", str(api.tmp)],
            "inventory": {"gpus": gpus, "cpu_count": 8, "memory_total_mb": memory_mb},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def vllm_body(**task: Any) -> dict[str, Any]:
    return service_body(
        name="v",
        task={
            "image": "vllm/vllm-openai:v0.11.2",
            "gpu_required": 1,
            "model_path": "qwen",  # a name under /data/models: needs no registered node
            **task,
        },
    )


def rows(api: Api, table: type) -> int:
    with api.app.db.session() as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


@pytest.mark.feature("C12")
@pytest.mark.parametrize(
    ("body", "why"),
    [
        (vllm_body(kv_offload_gb=8) | {"task_type": "training"}, "inference services"),
        (service_body(task={"kv_offload_gb": 8}), "only vLLM"),
        (vllm_body(kv_offload_gb=8, command=["python", "serve.py"]), "custom command"),
        (
            service_body(
                task={"image": "lmsysorg/sglang:v0.5", "gpu_required": 1, "kv_offload_gb": 4}
            ),
            "only vLLM",
        ),
    ],
)
def test_kv_offload_is_refused_outside_vllm_inference(
    api: Api, body: dict[str, Any], why: str
) -> None:
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == "task.kv_offload_gb" and why in err["message"]


@pytest.mark.feature("C12")
def test_kv_offload_range_and_vllm_acceptance(api: Api) -> None:
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=vllm_body(kv_offload_gb=4097), headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.kv_offload_gb"
    r = api.client.post("/api/v1/task-groups", json=vllm_body(kv_offload_gb=16), headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["tasks"][0]["kv_offload_gb"] == 16


def test_dry_run_plans_a_cpu_service_and_writes_nothing(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    node_id = heartbeat(api, "cpu-node", [], {"llamacpp": ""})
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    body = service_body(task={"model_path": str(model), "engine_args": ["-np", "2"]})
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["dry_run"] is True and plan["engine"] == "llamacpp"
    assert "image name" in plan["engine_reason"]
    task = plan["tasks"][0]
    assert task["placement"]["node_id"] == node_id
    assert task["placement"]["host_ports"] == [21000]
    c = task["container"]
    assert c["entrypoint"] is None  # the llama.cpp image's entrypoint already is llama-server
    assert "llama-server" not in c["command"]
    assert c["command"][c["command"].index("-m") + 1] == str(model)
    assert c["command"][c["command"].index("--port") + 1] == "8000"
    assert "-np" in c["command"]
    assert c["mounts"] == [{"source": str(model), "target": str(model), "read_only": True}]
    # C14: the engine's port on the node's private loopback; its door on the node's address
    assert c["ports"] == [{"container_port": 8000, "host_ip": ENGINE_ADDRESS, "host_port": 21000}]
    assert plan["estimate_detail"]  # the tiny GGUF is readable here, so it is estimated
    assert plan["memory_mb"] > 0
    assert [rows(api, t) for t in (TaskGroup, Task, InferenceEndpoint)] == [0, 0, 0]


@pytest.mark.feature("C5")
def test_dry_run_tensor_parallel_vllm_container(api: Api) -> None:
    admin = api.login()
    heartbeat(api, "gpu-node", [A10, {**A10, "index": 1}], {"vllm": "vllm/vllm-openai:v0.11.2"})
    body = vllm_body() | {"parallelism": "tensor_parallel", "world_size": 2}
    plan = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin).json()
    task = plan["tasks"][0]
    assert sorted(task["placement"]["gpu_ids"]) == [0, 1]
    c = task["container"]
    assert (c["ipc_mode"], c["shm_size"], c["network_mode"]) == (None, "16g", None)
    assert c["gpu"]["vendor"] == "nvidia" and sorted(c["gpu"]["device_ids"]) == ["0", "1"]
    args = c["command"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"
    # F1: vLLM on CUDA cards starts with its own sleep mode, and the preview says so; its
    # development routes are on for the agent (the door keeps them from the network)
    assert "--enable-sleep-mode" in args and c["env"]["VLLM_SERVER_DEV_MODE"] == "1"


def test_dry_run_says_why_nothing_fits_and_still_validates(api: Api) -> None:
    admin = api.login()
    plan = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=vllm_body(), headers=admin
    ).json()
    assert plan["tasks"][0]["placement"] is None
    assert "no node has registered" in plan["tasks"][0]["pending_reason"]
    r = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=vllm_body() | {"image": "x"}, headers=admin
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "image"


@pytest.mark.feature("B8")
def test_create_refuses_a_model_no_node_could_ever_hold(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    heartbeat(api, "small", [], {"llamacpp": ""}, memory_mb=64)
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(task={"model_path": str(model)}), headers=admin
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == "task.model_path" and "MB" in err["message"]
    assert rows(api, TaskGroup) == 0


@pytest.mark.feature("B8")
def test_estimate_is_recorded_and_used_when_the_model_is_readable(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    heartbeat(api, "n", [], {"llamacpp": ""})  # allows tmp_path (C4)
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    g = api.client.post(
        "/api/v1/task-groups", json=service_body(task={"model_path": str(model)}), headers=admin
    ).json()
    t = g["tasks"][0]
    assert t["estimate_detail"] and t["memory_mb"] > 0
    # an unreadable path is simply not estimated
    g2 = api.client.post(
        "/api/v1/task-groups",
        json=service_body(name="b", task={"model_path": str(tmp_path / "nope" / "x.gguf")}),
        headers=admin,
    ).json()
    assert g2["tasks"][0]["estimate_detail"] == "" and g2["tasks"][0]["memory_mb"] == 0


@pytest.mark.feature("H2")
def test_inference_template_endpoint(api: Api) -> None:
    admin = api.login()
    a10 = heartbeat(
        api,
        "a10",
        [A10],
        {
            "vllm": "vllm/vllm-openai:v0.11.2",
            "sglang": "lmsysorg/sglang:v0.5.5",
            "llamacpp": "ghcr.io/ggml-org/llama.cpp:server",
        },
    )
    cpu = heartbeat(api, "cpu", [], {"llamacpp": ""})
    bare = heartbeat(api, "bare", [], {})
    got = api.client.get(f"/api/v1/nodes/{a10}/inference-template", headers=admin).json()
    assert [t["engine"] for t in got] == ["vllm", "sglang", "llamacpp"]
    assert got[0]["image"] == "vllm/vllm-openai:v0.11.2"
    got = api.client.get(f"/api/v1/nodes/{cpu}/inference-template", headers=admin).json()
    assert [t["engine"] for t in got] == ["llamacpp"]
    assert api.client.get(f"/api/v1/nodes/{bare}/inference-template", headers=admin).json() == []
    r = api.client.get("/api/v1/nodes/node-000000000000/inference-template", headers=admin)
    assert r.status_code == 404
    nodes = {n["name"]: n for n in api.client.get("/api/v1/nodes", headers=admin).json()}
    assert nodes["cpu"]["engines"] == {"llamacpp": ""}


def test_task_shows_the_argv_the_agent_launched(api: Api) -> None:
    admin = api.login()
    node_id = heartbeat(api, "n", [], {"llamacpp": ""})
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    task_id = g["tasks"][0]["id"]
    assert g["tasks"][0]["launch_argv"] == []
    api.app.scheduler.run_round()
    api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    argv = ["python", "-m", "heteroflow.engines.llamacpp_server", "-m", "/models/tiny.gguf"]
    r = api.agent_post(
        node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running", "argv": argv}
    )
    assert r.status_code == 200
    assert api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()["launch_argv"] == argv


@pytest.mark.feature("H2")
def test_one_click_takes_the_first_template_and_stores_the_chain(api: Api) -> None:
    admin = api.login()
    heartbeat(
        api,
        "a10",
        [A10],
        {"vllm": "vllm/vllm-openai:v0.11.2", "llamacpp": "ghcr.io/ggml-org/llama.cpp:server"},
    )
    body = service_body(task={"image": "", "gpu_required": 1, "model_path": "/data/models/q"})
    g = api.client.post("/api/v1/task-groups", json=body, headers=admin).json()
    assert g["parallelism"] == "split"
    assert [t["engine"] for t in g["inference_templates"]] == ["vllm", "llamacpp"]
    t = g["tasks"][0]
    assert (t["engine"], t["image"]) == ("vllm", "vllm/vllm-openai:v0.11.2")
    assert t["engine_reason"].startswith("one-click template")


@pytest.mark.feature("H2")
def test_one_click_on_a_cpu_node_serves_llamacpp_on_the_cpu(api: Api) -> None:
    admin = api.login()
    heartbeat(api, "cpu", [], {"llamacpp": ""})
    body = service_body(task={"image": "", "gpu_required": 1})
    g = api.client.post("/api/v1/task-groups", json=body, headers=admin).json()
    assert (g["tasks"][0]["engine"], g["tasks"][0]["gpu_required"]) == ("llamacpp", 0)


@pytest.mark.feature("H2")
def test_one_click_fails_before_creating_anything_when_no_engine_fits(api: Api) -> None:
    admin = api.login()
    heartbeat(
        api,
        "p100",
        [{**A10, "model": "P100", "compute_capability": "6.0"}],
        {"vllm": "vllm/vllm-openai:v0.11.2"},
    )
    body = service_body(task={"image": "", "gpu_required": 1})
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.image"
    assert [rows(api, t) for t in (TaskGroup, Task, InferenceEndpoint)] == [0, 0, 0]


@pytest.mark.feature("H1", "H2")
def test_one_click_keeps_the_engine_the_request_names(api: Api) -> None:
    """An explicit task.engine with no image: that engine's template, never the chain's
    first (vLLM here), and only that one (no fallback to another engine)."""
    admin = api.login()
    heartbeat(
        api,
        "a10",
        [A10],
        {"vllm": "vllm/vllm-openai:v0.11.2", "llamacpp": "ghcr.io/ggml-org/llama.cpp:server"},
    )
    body = service_body(task={"image": "", "engine": "llamacpp", "gpu_required": 1,
                              "model_path": "/data/models/q.gguf"})
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["engine"] == "llamacpp"
    g = api.client.post("/api/v1/task-groups", json=body, headers=admin).json()
    t = g["tasks"][0]
    assert (t["engine"], t["image"]) == ("llamacpp", "ghcr.io/ggml-org/llama.cpp:server")
    assert [x["engine"] for x in g["inference_templates"]] == ["llamacpp"]
    assert "named by task.engine" in t["engine_reason"]


@pytest.mark.feature("H2")
def test_one_click_refuses_a_named_engine_no_node_reports(api: Api) -> None:
    admin = api.login()
    heartbeat(api, "a10", [A10], {"vllm": "vllm/vllm-openai:v0.11.2"})
    body = service_body(task={"image": "", "engine": "sglang", "gpu_required": 1,
                              "model_path": "/data/models/q"})
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == "task.engine" and "'sglang'" in err["message"]
    assert "vllm" in err["message"]  # what the nodes do report
    assert [rows(api, t) for t in (TaskGroup, Task, InferenceEndpoint)] == [0, 0, 0]


@pytest.mark.feature("H1")
def test_scheduler_applies_the_node_chain_when_no_engine_is_named(api: Api) -> None:
    admin = api.login()
    body = service_body(task={"image": "myorg/inference-server:1", "gpu_required": 1})
    g = api.client.post("/api/v1/task-groups", json=body, headers=admin).json()
    assert g["tasks"][0]["engine"] == ""
    heartbeat(api, "bare", [A10], {})
    api.app.scheduler.run_round()
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=admin).json()
    assert t["status"] == "pending" and t["status_message"].startswith("NoEngineAvailable")
    heartbeat(api, "ready", [A10], {"sglang": "lmsysorg/sglang:v0.5.5"})
    assert api.app.scheduler.run_round().placed == 1
    t = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=admin).json()
    assert t["status"] == "scheduled" and t["engine"] == "sglang"
    assert t["engine_reason"].startswith("on ready:")
