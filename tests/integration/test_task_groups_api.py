"""POST/GET/DELETE /api/v1/task-groups on a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import func, select, text

from heteroflow.db.tables import InferenceEndpoint, ModelRoute, Task, TaskGroup

from .conftest import Api, service_body

pytestmark = pytest.mark.feature("A6")


def count(api: Api, table: type) -> int:
    with api.app.db.session() as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


def test_create_returns_ids_pending_endpoint_and_key_once(api: Api) -> None:
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    assert r.status_code == 201, r.text
    g = r.json()
    assert g["id"].startswith("tg-") and g["status"] == "pending"
    assert g["endpoint"].startswith("ep-")
    assert re.fullmatch(
        r"sk-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", g["api_key"]
    )
    assert g["tasks"][0]["id"].startswith("task-")
    # the key is never shown again
    again = api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).json()
    assert "api_key" not in again and g["api_key"] not in str(again)
    listed = api.client.get("/api/v1/task-groups", headers=admin).json()
    assert [x["id"] for x in listed] == [g["id"]]


def test_model_path_forces_enable_api_and_default_port_8000(api: Api) -> None:
    admin = api.login()
    g = api.client.post(
        "/api/v1/task-groups", json=service_body(enable_api=False), headers=admin
    ).json()
    assert g["enable_api"] is True and g["task_type"] == "inference"
    assert g["tasks"][0]["ports"] == [{"container_port": 8000, "host_port": 0}]
    assert g["health_check"]["port"] == 8000


@pytest.mark.feature("A4")
def test_route_auto_created_priority0_weight100_active(api: Api) -> None:
    admin = api.login()
    g = api.client.post(
        "/api/v1/task-groups", json=service_body(model_name="tiny-chat"), headers=admin
    ).json()
    routes = api.client.get(f"/api/v1/model-routes?group_id={g['id']}", headers=admin).json()
    assert len(routes) == 1
    r = routes[0]
    assert r["id"].startswith("mr-")
    assert (r["model_name"], r["priority"], r["weight"], r["active"]) == ("tiny-chat", 0, 100, True)


@pytest.mark.feature("A5")
def test_model_name_defaults_to_name(api: Api) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(name="my-svc"), headers=admin)
    assert g.json()["model_name"] == "my-svc"


@pytest.mark.parametrize("field", ["image", "gpu_required", "model_path", "ports", "engine"])
def test_container_field_at_top_level_is_400_naming_it(api: Api, field: str) -> None:
    admin = api.login()
    body = service_body()
    body[field] = body["task"].get(field, 1)
    before = count(api, TaskGroup)
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["field"] == field and "inside 'task'" in err["message"]
    assert count(api, TaskGroup) == before


@pytest.mark.parametrize(
    ("body_over", "field"),
    [
        ({"colour": "red"}, "colour"),
        ({"task": {"gpu_required": 65}}, "task.gpu_required"),
        ({"task": {"typo_field": 1}}, "task.typo_field"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"co_schedule": True}, "co_schedule"),
        ({"qos": "gold"}, "qos"),
        ({"task": {"engine": "tensorflow"}}, "task.engine"),
        ({"task": {"ports": [{"container_port": 70000}]}}, "task.ports.0.container_port"),
        ({"parallelism": "pipeline"}, "parallelism"),
        ({"health_check": {"port": 9999}}, "health_check.port"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    api: Api, body_over: dict[str, Any], field: str
) -> None:
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=service_body(**body_over), headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field


def test_body_that_is_not_an_object_is_400(api: Api) -> None:
    admin = api.login()
    for raw in ("[1,2]", "null", "not json"):
        r = api.client.post(
            "/api/v1/task-groups",
            content=raw,
            headers={**admin, "Content-Type": "application/json"},
        )
        assert r.status_code == 400, (raw, r.text)


@pytest.mark.feature("A11")
def test_inference_without_model_path_or_command_is_400(api: Api) -> None:
    admin = api.login()
    r = api.client.post(
        "/api/v1/task-groups",
        json=service_body(enable_api=True, task={"model_path": ""}),
        headers=admin,
    )
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "task.model_path"


def test_gpu_zero_needs_a_cpu_engine(api: Api) -> None:
    """SGLang has no CPU build at all (docs/engines.md); vLLM's CPU build is judged by
    the nodes that report it (tests/integration/test_vllm_cpu_placement.py)."""
    admin = api.login()
    r = api.client.post(
        "/api/v1/task-groups",
        json=service_body(task={"image": "lmsysorg/sglang:latest", "gpu_required": 0}),
        headers=admin,
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.gpu_required"
    assert "runs on the CPU" in r.json()["error"]["message"]


@pytest.mark.feature("A3")
def test_duplicate_endpoint_name_is_409_before_anything_is_written(api: Api) -> None:
    admin = api.login()
    assert (
        api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).status_code
        == 201
    )
    before = [count(api, t) for t in (TaskGroup, Task, ModelRoute, InferenceEndpoint)]
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    assert r.status_code == 409
    assert r.json()["error"]["field"] == "name"
    # issue 33: the user named a service, and the message says so
    assert r.json()["error"]["message"].startswith("a service named 'svc' already exists")
    assert [count(api, t) for t in (TaskGroup, Task, ModelRoute, InferenceEndpoint)] == before
    named = service_body(name="other", endpoint_name="svc")
    r = api.client.post("/api/v1/task-groups", json=named, headers=admin)
    assert r.status_code == 409 and r.json()["error"]["field"] == "endpoint_name"
    assert r.json()["error"]["message"].startswith("an endpoint named 'svc' already exists")


@pytest.mark.feature("A3")
def test_same_endpoint_name_in_another_tenant_is_fine(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team-b", "bob")
    assert (
        api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).status_code
        == 201
    )
    assert (
        api.client.post("/api/v1/task-groups", json=service_body(), headers=member).status_code
        == 201
    )


@pytest.mark.feature("A3")
def test_only_hash_and_prefix_are_stored(api: Api) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    key = g["api_key"]
    with api.app.db.session() as s:
        ep = s.get(InferenceEndpoint, g["endpoint"])
        assert ep is not None
        import hashlib

        assert ep.key_hash == hashlib.sha256(key.encode()).hexdigest()
        assert ep.key_prefix == key[:7] + "…"
        dump = " ".join(
            str(row)
            for table in ("inference_endpoints", "task_groups", "events")
            for row in s.execute(text(f"SELECT * FROM {table}"))  # noqa: S608
        )
    assert key not in dump and key[8:] not in dump


@pytest.mark.feature("A3")
def test_endpoint_port_must_be_a_group_port_unless_operator(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team-c", "carol")
    body = service_body(endpoint_port=9000)
    r = api.client.post("/api/v1/task-groups", json=body, headers=member)
    assert r.status_code == 400 and r.json()["error"]["field"] == "endpoint_port"
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(name="x2", external_port=70000), headers=admin
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "external_port"


@pytest.mark.feature("G1")
def test_split_creates_one_task_per_replica(api: Api) -> None:
    admin = api.login()
    g = api.client.post(
        "/api/v1/task-groups",
        json=service_body(parallelism="split", world_size=3),
        headers=admin,
    ).json()
    assert [t["rank"] for t in g["tasks"]] == [0, 1, 2]
    assert g["current_replicas"] == 3


@pytest.mark.feature("G1")
def test_tensor_parallel_is_one_task_with_world_size_cards(api: Api) -> None:
    admin = api.login()
    g = api.client.post(
        "/api/v1/task-groups",
        json=service_body(
            parallelism="tensor_parallel",
            world_size=2,
            task={"image": "vllm/vllm-openai:v0.11.2", "gpu_required": 1},
        ),
        headers=admin,
    ).json()
    assert len(g["tasks"]) == 1 and g["tasks"][0]["gpu_required"] == 2
    assert g["tasks"][0]["engine"] == "vllm"
    assert "image name" in g["tasks"][0]["engine_reason"]


def test_delete_removes_group_routes_endpoint_and_stops_tasks(api: Api) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    assert api.client.delete(f"/api/v1/task-groups/{g['id']}", headers=admin).status_code == 204
    assert api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).status_code == 404
    assert api.client.get("/api/v1/gateway/endpoints", headers=admin).json() == []
    assert api.client.get("/api/v1/model-routes", headers=admin).json() == []
    task = api.client.get(f"/api/v1/tasks/{g['tasks'][0]['id']}", headers=admin).json()
    assert task["status"] == "stopped"
    # the name is free again
    assert (
        api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).status_code
        == 201
    )


def test_unknown_ids_are_404(api: Api) -> None:
    admin = api.login()
    for method, path in [
        ("GET", "/api/v1/task-groups/tg-000000000000"),
        ("DELETE", "/api/v1/task-groups/tg-000000000000"),
        ("GET", "/api/v1/tasks/task-000000000000"),
        ("POST", "/api/v1/tasks/task-000000000000/stop"),
        ("DELETE", "/api/v1/gateway/endpoints/ep-000000000000"),
    ]:
        r = api.client.request(method, path, headers=admin)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("args", [["-m", "/etc/passwd"], ["--host", "0.0.0.0"], ["--port=1"]])
def test_engine_args_may_not_set_platform_owned_flags(api: Api, args: list[str]) -> None:
    admin = api.login()
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(task={"engine_args": args}), headers=admin
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.engine_args"


def test_model_name_may_not_hold_commas_or_spaces(api: Api) -> None:
    admin = api.login()
    for bad in ("a,b", "a b", ""):
        r = api.client.post("/api/v1/task-groups", json=service_body(model_name=bad), headers=admin)
        assert r.status_code == 400 and r.json()["error"]["field"] == "model_name"


def test_an_endpoint_that_cannot_be_written_fails_the_whole_create(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: the group, its tasks, route and endpoint (with its key) are one unit of
    work — before, a failed endpoint was a warning and left a service without a key."""
    import heteroflow.services.lifecycle.task_groups as svc

    def broken_key() -> str:
        raise RuntimeError("key generator down")

    monkeypatch.setattr(svc, "new_api_key", broken_key)
    admin = api.login()
    with pytest.raises(RuntimeError, match="key generator down"):  # the server's 500
        api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    for table in (TaskGroup, Task, ModelRoute, InferenceEndpoint):
        assert count(api, table) == 0, table
