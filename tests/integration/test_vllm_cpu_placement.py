"""A vLLM task without cards, through the real API and scheduler (issue 28 item 1): the
create refuses it, naming the field, where no node the caller may use runs vLLM's CPU
build, accepts it once one does, and the scheduler places it there — never on a plain
process-runtime node, whose pending reason says why."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import NODE_TOKEN, Api

MODEL_DIR = "/models/tiny-hermes"  # a test prefix every heartbeat below allows


def heartbeat(api: Api, name: str, engines: dict[str, str]) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name,
            "address": "127.0.0.1",
            "runtime": "process",
            "engines": engines,
            "allowed_volume_prefixes": ["/models"],
            "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384,
                          "memory_available_mb": 16384},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def body(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model_name": f"{name}-model",
        "task": {"engine": "vllm", "image": "vllm/vllm-openai:v0.32.0", "gpu_required": 0,
                 "model_path": MODEL_DIR,
                 "memory_mb": 4096, "engine_args": ["--max-model-len", "256"]},
    }


def task_of(api: Api, admin: dict[str, str], group: dict[str, Any]) -> dict[str, Any]:
    tid = group["tasks"][0]["id"]
    return dict(api.client.get(f"/api/v1/tasks/{tid}", headers=admin).json())


@pytest.mark.feature("A6")
def test_a_cpu_vllm_service_runs_only_where_a_node_runs_vllms_cpu_build(api: Api) -> None:
    admin = api.login()
    plain = heartbeat(api, "plain", {"llamacpp": ""})
    for url in ("/api/v1/task-groups?dry_run=true", "/api/v1/task-groups"):
        r = api.client.post(url, json=body("early"), headers=admin)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "task.engine", err  # no node here starts vLLM at all
        assert "vLLM" in err["message"]
    # a node with vLLM's GPU build only: vLLM starts there, but not without a card
    heartbeat(api, "gpu-build", {"llamacpp": "", "vllm": ""})
    r = api.client.post("/api/v1/task-groups", json=body("early"), headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.gpu_required", r.text
    assert "CPU build" in r.json()["error"]["message"]

    cpu = heartbeat(api, "cpu-build", {"llamacpp": "", "vllm": "cpu"})
    plan = api.client.post("/api/v1/task-groups?dry_run=true", json=body("svc"), headers=admin)
    assert plan.status_code == 200, plan.text
    assert plan.json()["tasks"][0]["placement"]["node_name"] == "cpu-build"
    g = api.client.post("/api/v1/task-groups", json=body("svc"), headers=admin).json()
    api.app.scheduler.run_round()
    t = task_of(api, admin, g)
    assert (t["status"], t["node_id"]) == ("scheduled", cpu)
    assert t["node_id"] != plain

    # its agent lost vLLM (restarted without HETEROFLOW_AGENT_VLLM_PYTHON): no new one
    heartbeat(api, "cpu-build", {"llamacpp": ""})
    g2 = api.client.post("/api/v1/task-groups", json=body("svc2"), headers=admin)
    assert g2.status_code == 400, g2.text  # no node runs the CPU build any more
