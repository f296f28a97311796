"""An inference ``pipeline`` group through the API (issue 32 item 3, G1): vLLM serves one
model across two nodes running its CPU build — the dry run shows rank 0's API server and
rank 1's headless stage, both meeting at rank 0's booked rendezvous; a round places the
gang on the two nodes; once both run, the routing snapshot lists rank 0 alone. An engine
whose stages are not wired is refused with a 400 that says why and which engine takes it.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from heteroflow.db.tables import Task
from heteroflow.services.serving.routing import build_snapshot

from .conftest import NODE_TOKEN, Api

ADDRESSES = {"pp-a": "10.0.0.1", "pp-b": "10.0.0.2"}
MODEL_DIR = "/models/tiny-hermes"


def heartbeat(api: Api, name: str) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name,
            "address": ADDRESSES[name],
            "runtime": "process",
            "engines": {"llamacpp": "", "vllm": "cpu"},
            "allowed_volume_prefixes": ["/models"],
            "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384,
                          "memory_available_mb": 16384},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def body(engine: str = "vllm", image: str = "vllm/vllm-openai:v0.32.0") -> dict[str, Any]:
    return {
        "name": "pp",
        "model_name": "tiny-pp",
        "parallelism": "pipeline",
        "world_size": 2,
        "task": {"engine": engine, "image": image, "gpu_required": 0,
                 "model_path": MODEL_DIR, "memory_mb": 2048,
                 "engine_args": ["--max-model-len", "256", "--dtype", "float32"]},
    }


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.feature("G1")
def test_a_vllm_pipeline_is_planned_placed_and_routed_to_rank_0(api: Api) -> None:
    admin = api.login()  # an operator: pipeline stages share their hosts' network
    ids = {heartbeat(api, name): address for name, address in ADDRESSES.items()}
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=body(), headers=admin)
    assert r.status_code == 200, r.text
    planned = r.json()["tasks"]
    master = planned[0]["placement"]
    assert master is not None and {t["placement"]["node_id"] for t in planned} == set(ids)
    rendezvous = str(master["host_ports"][1])
    argv = [t["container"]["command"] for t in planned]
    assert "vllm.entrypoints.openai.api_server" in argv[0] and "--headless" not in argv[0]
    assert "--headless" in argv[1] and "-c" in argv[1]  # vLLM's serve command
    for rank, t in enumerate(planned):
        cmd = argv[rank]
        assert flag(cmd, "--node-rank") == str(rank)
        assert flag(cmd, "--master-addr") == ids[master["node_id"]]
        assert flag(cmd, "--master-port") == rendezvous
        env = t["container"]["env"]
        assert env["VLLM_HOST_IP"] == ids[t["placement"]["node_id"]]  # each its own node's

    g = api.client.post("/api/v1/task-groups", json=body(), headers=admin)
    assert g.status_code == 201, g.text
    assert api.app.scheduler.run_round().placed == 2
    with api.app.db.session() as s:
        s.execute(update(Task).where(Task.group_id == g.json()["id"]).values(status="running"))
    with api.app.db.session() as s:
        rank0 = s.scalar(select(Task.id).where(Task.group_id == g.json()["id"], Task.rank == 0))
        snapshot = build_snapshot(s, 1)
    [target] = [t for (_, model), ts in snapshot.routes.items() if model == "tiny-pp" for t in ts]
    assert [b.task_id for b in target.backends] == [rank0]  # the headless stage is no backend


@pytest.mark.feature("G1")
@pytest.mark.parametrize(
    ("engine", "image", "named"),
    [
        ("sglang", "lmsysorg/sglang:latest", "sglang"),
        ("", "ghcr.io/ggml-org/llama.cpp:server", "llamacpp"),
    ],
)
def test_a_pipeline_on_an_engine_without_wired_stages_is_400_saying_which_engine_takes_it(
    api: Api, engine: str, image: str, named: str
) -> None:
    admin = api.login()
    for name in ADDRESSES:
        heartbeat(api, name)
    for dry in (True, False):
        r = api.client.post(
            f"/api/v1/task-groups{'?dry_run=true' if dry else ''}",
            json=body(engine, image), headers=admin,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "parallelism", err
        assert "vllm only" in err["message"] and named in err["message"], err
    assert api.client.get("/api/v1/task-groups", headers=admin).json() == []


@pytest.mark.feature("G1")
def test_a_cpu_pipeline_in_eager_mode_is_400_naming_the_flag(api: Api) -> None:
    admin = api.login()
    for name in ADDRESSES:
        heartbeat(api, name)
    eager = body()
    eager["task"]["engine_args"] = [*eager["task"]["engine_args"], "--enforce-eager"]
    lora = body()
    lora["task"]["max_loras"] = 1
    for req, field in ((eager, "task.engine_args"), (lora, "task.max_loras")):
        r = api.client.post("/api/v1/task-groups", json=req, headers=admin)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == field, r.text
        assert "pipeline" in r.json()["error"]["message"]
