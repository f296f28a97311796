"""A scheduler round with the 10,000-node shortcuts, end to end on both databases:
preemption looks only at the nodes of the type asked for and still finds its victim
there (B4), and a round leaves Python's cyclic collector as it found it."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from .conftest import Api


def cards(model: str, n: int, total: int) -> list[dict[str, Any]]:
    return [
        {"index": i, "vendor": "nvidia", "model": model, "memory_total_mb": total}
        for i in range(n)
    ]


def job(name: str, priority: int, gpu_type: str) -> dict[str, Any]:
    return {
        "name": name, "task_type": "training", "priority": priority,
        "task": {"image": "busybox:1.36", "command": ["sleep", "3600"], "gpu_required": 1,
                 "gpu_type": gpu_type},
    }


def create(api: Api, headers: dict[str, str], body: dict[str, Any]) -> str:
    r = api.client.post("/api/v1/task-groups", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["tasks"][0]["id"])


def task(api: Api, headers: dict[str, str], task_id: str) -> dict[str, Any]:
    return dict(api.client.get(f"/api/v1/tasks/{task_id}", headers=headers).json())


@pytest.mark.feature("B4")
def test_preemption_of_a_typed_task_picks_its_victim_on_a_node_of_that_type(api: Api) -> None:
    admin = api.login()
    a10 = api.heartbeat("node-a10", gpus=cards("A10", 1, 23028))
    a100 = api.heartbeat("node-a100", gpus=cards("A100", 1, 81920))
    # the lowest priority sits on the A10: a victim by priority, but of the wrong type
    on_a10 = create(api, admin, job("low-a10", 1, "A10"))
    on_a100 = create(api, admin, job("low-a100", 10, "A100"))
    was = gc.isenabled()
    assert api.app.scheduler.run_round().placed == 2
    assert gc.isenabled() == was
    for tid, node in ((on_a10, a10), (on_a100, a100)):
        assert api.agent_post(node, f"/api/v1/agent/tasks/{tid}/claim", {}).status_code == 200
        r = api.agent_post(node, f"/api/v1/agent/tasks/{tid}/report", {"status": "running"})
        assert r.status_code == 200, r.text
    urgent = create(api, admin, job("urgent-a100", 500, "A100"))
    r = api.app.scheduler.run_round()
    assert (r.placed, r.preempted) == (0, 1)
    assert gc.isenabled() == was
    assert task(api, admin, on_a100)["preempted_by"] == urgent
    assert task(api, admin, on_a10)["status"] == "running"
    assert "on node-a100" in task(api, admin, urgent)["status_message"]
