"""The run timeout (A10): training and container tasks are stopped when it passes and
end ``failed`` with the reason; inference services are exempt by their type (400)."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, service_body
from .test_fault_events import create, faults, start
from .test_recovery import recovery_round, task


def job(kind: str = "training", timeout_s: int = 60, **over: Any) -> dict[str, Any]:
    return service_body(
        name=f"{kind}-job", task_type=kind, enable_api=False, run_timeout_seconds=timeout_s,
        task={"model_path": "", "command": ["python", "train.py"]}, **over,
    )


@pytest.mark.feature("A10")
@pytest.mark.parametrize("kind", ["training", "container"])
def test_a_task_past_its_run_timeout_fails_with_the_reason(api: Api, kind: str) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id, t = create(api, admin, job(kind))
    g = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()
    assert g["run_timeout_seconds"] == 60
    api.app.scheduler.run_round()
    start(api, node_id, t)
    api.clock.advance(60)
    api.heartbeat()
    assert recovery_round(api).timed_out == []  # not past it yet
    api.clock.advance(1)
    api.heartbeat()
    result = recovery_round(api)
    assert result.timed_out == [t] and result.rebuilt == []  # its result: not run again
    got = task(api, admin, t)
    assert got["status"] == "failed"
    assert got["status_message"].startswith("run timeout of 60 s exceeded")
    assert [e["kind"] for e in faults(api, admin, group_id)] == ["fault.run_timeout"]
    # its agent is no longer told to run it: the next heartbeat stops the engine
    assert api.heartbeat() == node_id
    assert recovery_round(api).timed_out == []


@pytest.mark.feature("A10")
def test_no_timeout_means_none(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    _, t = create(api, admin, job(timeout_s=0))
    api.app.scheduler.run_round()
    start(api, node_id, t)
    api.clock.advance(10 * 86400)
    api.heartbeat()
    assert recovery_round(api).timed_out == []
    assert task(api, api.login(), t)["status"] == "running"  # (the old token expired)


@pytest.mark.feature("A10")
@pytest.mark.parametrize(
    "body",
    [
        service_body(run_timeout_seconds=60),  # inferred inference (a model path)
        service_body(run_timeout_seconds=60, task_type="inference"),
        job("inference"),
        service_body(run_timeout_seconds=60, enable_api=True, task={"model_path": ""}),
    ],
)
def test_inference_is_exempt_400(api: Api, body: dict[str, Any]) -> None:
    admin = api.login()
    api.heartbeat()
    for dry in ("", "?dry_run=true"):
        r = api.client.post(f"/api/v1/task-groups{dry}", json=body, headers=admin)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "run_timeout_seconds"
        assert "inference" in r.json()["error"]["message"]


def test_run_timeout_must_be_a_whole_non_negative_number(api: Api) -> None:
    admin = api.login()
    for bad in (-1, 1.5, "60"):
        body = job()
        body["run_timeout_seconds"] = bad
        r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["field"] == "run_timeout_seconds"
