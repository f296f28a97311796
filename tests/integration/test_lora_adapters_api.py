"""LoRA adapters of a service (core.lora): max_loras at create, the adapter routes' rules,
and what the key, the routing snapshot and the agent's heartbeat see."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from heteroflow.schemas.routing import RoutingSnapshot, hash_key
from heteroflow.services.serving.routing import build_snapshot

from .conftest import NODE_TOKEN, Api, service_body


def vllm_body(max_loras: int = 2, **over: Any) -> dict[str, Any]:
    task = {"image": "vllm/vllm-openai:v0.10.0", "engine": "vllm", "gpu_required": 1,
            "model_path": "/models/base", "max_loras": max_loras, **over.pop("task", {})}
    return service_body(**{"name": "base", "model_name": "base", **over, "task": task})


def snapshot(api: Api) -> RoutingSnapshot:
    with api.app.db.session() as s:
        return build_snapshot(s, 1)


def create(api: Api, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


def adapters_url(group_id: str) -> str:
    return f"/api/v1/task-groups/{group_id}/adapters"


def error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


def test_max_loras_is_for_engines_that_load_adapters_at_runtime(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    # llama.cpp loads no adapter at runtime: 400 naming the field
    r = api.client.post("/api/v1/task-groups", headers=admin,
                        json=service_body(task={"max_loras": 2}))
    e = error(r, 400)
    assert e["field"] == "task.max_loras" and "vllm" in e["message"]
    # over the bound, and a custom command: 400 naming it too
    e = error(api.client.post("/api/v1/task-groups", headers=admin,
                              json=vllm_body(max_loras=9)), 400)
    assert "max_loras" in e["field"]
    e = error(api.client.post("/api/v1/task-groups", headers=admin, json=vllm_body(
        task={"command": ["python3", "-m", "x"], "engine": "", "image": "busybox:1"})), 400)
    assert e["field"] == "task.max_loras"
    g = create(api, admin, vllm_body(max_loras=2))
    assert g["tasks"][0]["max_loras"] == 2 and g["lora_adapters"] == []
    # the dry run shows the recipe's flags and variable
    r = api.client.post("/api/v1/task-groups?dry_run=true", headers=admin,
                        json=vllm_body(name="dry", model_name="dry"))
    assert r.status_code == 200, r.text
    plan = r.json()["tasks"][0]["container"]
    argv = list(plan["command"])
    at = argv.index("--enable-lora")
    assert argv[at:at + 3] == ["--enable-lora", "--max-loras", "2"]
    assert plan["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_an_adapter_is_a_model_name_of_the_service_key(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    api.heartbeat()
    g = create(api, admin, vllm_body())
    key = g["api_key"]
    folder = tmp_path / "lora-a"
    r = api.client.post(adapters_url(g["id"]), headers=admin,
                        json={"name": "base-sql", "path": str(folder)})
    assert r.status_code == 201, r.text
    assert r.json() == {"group_id": g["id"], "max_loras": 2,
                        "adapters": [{"name": "base-sql", "path": str(folder)}]}
    snap = snapshot(api)
    assert snap.keys[hash_key(key)].models == {"base", "base-sql"}
    (target,) = snap.routes[(g["tenant_id"], "base-sql")]
    assert target.adapter and target.group_id == g["id"]
    (base,) = snap.routes[(g["tenant_id"], "base")]
    assert not base.adapter
    # the snapshot's wire form keeps it (a separate gateway)
    again = RoutingSnapshot.from_wire(snap.to_wire())
    assert again.routes[(g["tenant_id"], "base-sql")][0].adapter
    listed = api.client.get(adapters_url(g["id"]), headers=admin).json()
    assert [a["name"] for a in listed["adapters"]] == ["base-sql"]
    assert api.client.get(f"/api/v1/task-groups/{g['id']}", headers=admin).json()[
        "lora_adapters"] == [{"name": "base-sql", "path": str(folder)}]
    # removing it takes the name away from the key at once
    r = api.client.delete(adapters_url(g["id"]) + "/base-sql", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["adapters"] == []
    assert snapshot(api).keys[hash_key(key)].models == {"base"}
    assert (g["tenant_id"], "base-sql") not in snapshot(api).routes
    error(api.client.delete(adapters_url(g["id"]) + "/base-sql", headers=admin), 404)


def test_adapter_rules_answer_naming_the_field(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    api.heartbeat()
    g = create(api, admin, vllm_body(max_loras=1))
    url = adapters_url(g["id"])
    ok = str(tmp_path / "a")
    # the model path's rule: outside the node's allow-list, a '..' segment, a URL
    for bad in ("/etc/lora", f"{tmp_path}/../x", "https://hub/x"):
        e = error(api.client.post(url, headers=admin, json={"name": "x", "path": bad}), 400)
        assert e["field"] == "path", (bad, e)
    # a name that is no model name
    e = error(api.client.post(url, headers=admin, json={"name": "a b", "path": ok}), 400)
    assert e["field"] == "name"
    # the service's own model, another model of the tenant
    other = create(api, admin, service_body(name="other", model_name="other"))
    for taken in ("base", "other"):
        e = error(api.client.post(url, headers=admin, json={"name": taken, "path": ok}), 409)
        assert e["field"] == "name"
    assert api.client.post(url, headers=admin, json={"name": "a1", "path": ok}).status_code == 201
    # every slot taken (max_loras 1)
    e = error(api.client.post(url, headers=admin, json={"name": "a2", "path": ok}), 409)
    assert e["field"] == "max_loras"
    # a name taken by another service's adapter
    g2 = create(api, admin, vllm_body(name="b2", model_name="b2"))
    e = error(api.client.post(adapters_url(g2["id"]), headers=admin,
                              json={"name": "a1", "path": ok}), 409)
    assert e["field"] == "name"
    # a service without LoRA slots; a service that is not there; another tenant's
    e = error(api.client.post(adapters_url(other["id"]), headers=admin,
                              json={"name": "z", "path": ok}), 409)
    assert e["field"] == "max_loras"
    error(api.client.post(adapters_url("tg-nope"), headers=admin,
                          json={"name": "z", "path": ok}), 404)
    member = api.member(admin, "acme", "ann")
    error(api.client.get(url, headers=member), 404)
    error(api.client.post(url, headers=member, json={"name": "z", "path": ok}), 404)
    # a new service may not take an adapter's name as its model (nor its dry run)
    for q in ("", "?dry_run=true"):
        e = error(api.client.post("/api/v1/task-groups" + q, headers=admin,
                                  json=service_body(name="n2", model_name="a1")), 409)
        assert e["field"] == "model_name" and g["id"] in e["message"]
    # the adapter's route goes with the adapter, not through the model-routes API
    (route,) = [r for r in api.client.get("/api/v1/model-routes", headers=admin).json()
                if r["model_name"] == "a1"]
    e = error(api.client.delete(f"/api/v1/model-routes/{route['id']}", headers=admin), 409)
    assert "/adapters/a1" in e["message"]
    # unknown fields are refused
    error(api.client.post(url, headers=admin, json={"name": "z", "path": ok, "x": 1}), 400)


def test_the_heartbeat_carries_the_adapters_and_the_agent_reports_loads(
    api: Api, tmp_path: Path
) -> None:
    admin = api.login()
    node = api.heartbeat(gpus=[H100])
    g = create(api, admin, vllm_body())
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    report = f"/api/v1/agent/tasks/{task_id}/report"
    # a LoRA note is for a running engine only
    r = api.agent_post(node, report, {"status": "starting", "note": "adapter", "message": "x"})
    assert r.status_code == 400, r.text
    assert api.agent_post(node, report, {"status": "running"}).status_code == 200
    folder = str(tmp_path / "lora-a")
    assert api.client.post(adapters_url(g["id"]), headers=admin,
                           json={"name": "ad-1", "path": folder}).status_code == 201
    (t,) = [t for t in beat(api) if t["id"] == task_id]
    assert t["max_loras"] == 2
    assert t["lora_adapters"] == [{"name": "ad-1", "path": folder}]
    # the agent says what the engine serves: the status message and an event, no change
    said = "serving LoRA adapter(s): ad-1"
    r = api.agent_post(node, report, {"status": "running", "note": "adapter", "message": said})
    assert r.status_code == 200, r.text
    task = api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()
    assert task["status"] == "running" and task["status_message"] == said
    events = api.client.get(f"/api/v1/task-groups/{g['id']}/events", headers=admin).json()
    assert any(e["kind"] == "task.lora_adapter" and e["message"] == said for e in events)
    # removing it empties the list the agent converges on
    assert api.client.delete(adapters_url(g["id"]) + "/ad-1", headers=admin).status_code == 200
    (t,) = [t for t in beat(api) if t["id"] == task_id]
    assert t["lora_adapters"] == []
    # the adapter writes are audited like every management write
    recs = api.client.get("/api/v1/audit", headers=admin).json()["records"]
    assert [(x["method"], x["status"]) for x in recs if "/adapters" in x["path"]] == [
        ("DELETE", 200), ("POST", 201)]


H100 = {"index": 0, "vendor": "nvidia", "model": "H100", "memory_total_mb": 81920}


def beat(api: Api) -> list[dict[str, Any]]:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "allowed_volume_prefixes": ["/models", str(api.tmp)],
              "inventory": {"gpus": [H100], "cpu_count": 4, "memory_total_mb": 16384,
                            "memory_available_mb": 16384}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return list(r.json()["tasks"])
