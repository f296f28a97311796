"""A gang's distributed environment through the API (G1, C1, issue 32 items 1 and 4).

A two-stage container gang on two nodes: the dry run shows each stage's MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE (rank 0's node and a port booked there from the pool);
the create writes it, a round places it the same way, and each stage's claim hands its
agent the same place, from which the agent builds the same environment. A pipeline
group whose stages' commands cannot be built is refused at create and dry run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.inventory import GpuCard
from heteroflow.db.tables import Task
from heteroflow.schemas.nodes import TaskAssignment

from .conftest import NODE_TOKEN, Api

ADDRESSES = {"gang-a": "10.0.0.1", "gang-b": "10.0.0.2"}


def node(api: Api, name: str) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name,
            "address": ADDRESSES[name],
            "runtime": "docker",
            "inventory": {
                "gpus": [{"index": 0, "vendor": "nvidia", "model": "A10",
                          "memory_total_mb": 24576}],
                "cpu_count": 4, "memory_total_mb": 16384, "memory_available_mb": 16384,
            },
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def gang(**task: Any) -> dict[str, Any]:
    return {
        "name": "gang",
        "task_type": "container",
        "parallelism": "pipeline",
        "world_size": 2,
        "task": {
            "image": "pytorch/pytorch:2.5.1",
            "command": ["torchrun", "--nnodes=2", "train.py"],
            "gpu_required": 1,
            "env": ["RANK=7", "NCCL_DEBUG=INFO"],  # RANK is the agent's: dropped
            **task,
        },
    }


@pytest.mark.feature("G1")
@pytest.mark.feature("C1")
@pytest.mark.feature("G3")
def test_a_two_stage_gang_gets_its_rank_world_and_master(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    ids = {name: node(api, name) for name in ADDRESSES}
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=gang(), headers=admin)
    assert r.status_code == 200, r.text
    planned = r.json()["tasks"]
    assert [t["rank"] for t in planned] == [0, 1]
    master = planned[0]["placement"]
    assert master is not None and len(master["host_ports"]) == 2  # + the rendezvous
    addr = {ids[n]: a for n, a in ADDRESSES.items()}[master["node_id"]]
    for rank, t in enumerate(planned):
        env = t["container"]["env"]
        assert env["MASTER_ADDR"] == addr
        assert env["MASTER_PORT"] == str(master["host_ports"][1])
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert env["HETEROFLOW_STAGE_PORT"] == str(t["placement"]["host_ports"][0])
        assert t["container"]["network_mode"] == "host"
    assert {t["placement"]["node_id"] for t in planned} == set(ids.values())  # one card each

    r = api.client.post("/api/v1/task-groups", json=gang(), headers=admin)
    assert r.status_code == 201, r.text
    assert api.app.scheduler.run_round().placed == 2
    with api.app.db.session() as s:
        rows = list(s.scalars(select(Task).where(Task.group_id == r.json()["id"])
                              .order_by(Task.rank)))
        placed = [(t.id, t.node_id) for t in rows]
    cards = [GpuCard(0, "u-0", "nvidia", "A10", 24576, 0, None, False, False, None, "declared")]
    for rank, (task_id, node_id) in enumerate(placed):
        assert node_id is not None
        c = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
        assert c.status_code == 200, c.text
        claimed = TaskAssignment.model_validate(c.json())
        assert claimed.gang == {
            "rank": rank, "world_size": 2, "master_addr": addr,
            "master_port": int(planned[0]["container"]["env"]["MASTER_PORT"]),
        }
        # the agent builds from the claim what the dry run showed
        launched = build_container(
            claimed, NodeConfig.from_dict({}), address=ADDRESSES[
                next(n for n, i in ids.items() if i == node_id)
            ], cards=cards, work_dir=tmp_path / "agent",
        )
        shown = planned[rank]["container"]["env"]
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                     "NODE_RANK", "HETEROFLOW_STAGE_PORT", "NCCL_DEBUG"):
            assert launched.env[name] == shown[name], name


@pytest.mark.feature("G1")
@pytest.mark.parametrize(
    "task",
    [
        # an engine image with its model: no engine builds a container stage's command
        {"image": "vllm/vllm-openai:v0.11.2", "command": [], "model_path": "qwen"},
        {"image": "lmsysorg/sglang:latest", "command": [], "model_path": "qwen"},
        {"image": "busybox:1.36", "command": []},  # nothing to run at all
    ],
)
def test_a_pipeline_group_whose_stages_cannot_start_is_400(
    api: Api, task: dict[str, Any]
) -> None:
    admin = api.login()
    for name in ADDRESSES:
        node(api, name)
    for dry in (True, False):
        r = api.client.post(
            f"/api/v1/task-groups{'?dry_run=true' if dry else ''}", json=gang(**task),
            headers=admin,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "task.command", r.text
    assert api.client.get("/api/v1/task-groups", headers=admin).json() == []
