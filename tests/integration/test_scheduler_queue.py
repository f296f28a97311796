"""B4's queue: pending work is taken by priority (higher first), FIFO within a priority.

One card, three jobs: the youngest has the highest priority and must be placed first
(without preempting anything), then the two equal-priority jobs in the order they came.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api

H100 = {"index": 0, "vendor": "nvidia", "model": "H100", "memory_total_mb": 81920}


def job(api: Api, headers: dict[str, str], name: str, priority: int) -> str:
    body = {
        "name": name,
        "task_type": "training",
        "priority": priority,
        "task": {"image": "busybox:1.36", "command": ["sleep", "3600"], "gpu_required": 1},
    }
    r = api.client.post("/api/v1/task-groups", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["tasks"][0]["id"])


def status(api: Api, headers: dict[str, str], task_id: str) -> str:
    t: dict[str, Any] = api.client.get(f"/api/v1/tasks/{task_id}", headers=headers).json()
    return str(t["status"])


def run_to_completion(api: Api, node_id: str, task_id: str) -> None:
    """The agent claims it, it runs, it exits 0: the card is free again."""
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    for reported in ("running", "completed"):
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": reported})
        assert r.status_code == 200, r.text


@pytest.mark.feature("B4")
def test_higher_priority_first_then_first_come_first_served(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat(gpus=[H100])
    old_low = job(api, admin, "old-low", priority=1)
    api.clock.advance(1)
    young_low = job(api, admin, "young-low", priority=1)
    api.clock.advance(1)
    high = job(api, admin, "high", priority=5)

    r = api.app.scheduler.run_round()
    assert (r.placed, r.preempted) == (1, 0)  # taken first, not by preempting
    assert [status(api, admin, t) for t in (high, old_low, young_low)] == [
        "scheduled", "pending", "pending"
    ]
    run_to_completion(api, node_id, high)

    assert api.app.scheduler.run_round().placed == 1
    assert [status(api, admin, t) for t in (old_low, young_low)] == ["scheduled", "pending"]
    run_to_completion(api, node_id, old_low)

    assert api.app.scheduler.run_round().placed == 1
    assert status(api, admin, young_low) == "scheduled"
