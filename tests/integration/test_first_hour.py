"""Issue 12's small dead ends, each as a user met it."""

from __future__ import annotations

from .conftest import Api, service_body


def test_a_cpu_service_reports_the_world_size_it_was_created_with(api: Api) -> None:
    """``world_size`` 1 in came back 0 for a CPU (0-GPU) service: ranks are not cards."""
    admin = api.login()
    api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(world_size=1), headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["world_size"] == 1
