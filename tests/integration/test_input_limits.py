"""Validation at the door (issue 10, item 6): what an attacker found, now a 400.

Each attack is sent as it was found and must come back 400 in the project's error shape
(``{"error": {"code", "message", "field"}}``) naming the field — never a 500 (the
database driver choking on a 64-bit integer or a NUL), never a 201. Where an attack used
to write something, the rows are counted. Two walks hold the line for fields added later:
every request field in the OpenAPI document is bounded, and every request string refuses
NUL characters.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import heteroflow.schemas
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NodeInventory, NvmlDiscovery
from heteroflow.core.paths import model_path_problem, volume_allows
from heteroflow.db.tables import (
    FileRequestChunk,
    InferenceEndpoint,
    ModelRoute,
    Node,
    Task,
    TaskGroup,
    UsageRecord,
)
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas import common
from heteroflow.settings import AgentSettings

from .conftest import NODE_TOKEN, Api, service_body

WRITTEN = (TaskGroup, Task, InferenceEndpoint, ModelRoute)


def rows(api: Api, *tables: type) -> list[int]:
    with api.app.db.session() as s:
        return [int(s.scalar(select(func.count()).select_from(t)) or 0) for t in tables]


def refused(r: Any, field: str, *words: str) -> dict[str, Any]:
    """A 400 in the error shape that names ``field``; returns the error."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error" and err["field"] == field, err
    for w in words:
        assert w in err["message"], err
    return dict(err)


def create(api: Api, who: dict[str, str], body: dict[str, Any], dry: bool = False) -> Any:
    url = "/api/v1/task-groups" + ("?dry_run=true" if dry else "")
    return api.client.post(url, json=body, headers=who)


# --- the attacks as found ----------------------------------------------------------------


def test_a_10mb_label_is_refused_and_nothing_is_written(api: Api) -> None:
    admin = api.login()
    body = service_body(labels={"team": "x" * (10 * 1024 * 1024)})
    refused(create(api, admin, body), "labels.team", "256")
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({f"k{i}": "v" for i in range(65)}, "labels"),  # at most 64 entries
        ({"k" * 64: "v"}, "labels." + "k" * 64 + ".[key]"),
        ({"bad key": "v"}, "labels.bad key.[key]"),
        ({"-leading": "v"}, "labels.-leading.[key]"),
        ({"ok": "v" * 257}, "labels.ok"),
        ({"ok": 5}, "labels.ok"),  # no number for a string
    ],
)
def test_label_limits(api: Api, labels: dict[str, Any], field: str) -> None:
    admin = api.login()
    refused(create(api, admin, service_body(labels=labels)), field)
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("task", "field"),
    [
        ({"gpu_required": True}, "task.gpu_required"),  # a bool is not an int
        ({"gpu_required": 1.0}, "task.gpu_required"),  # nor is a float
        ({"gpu_required": "1"}, "task.gpu_required"),  # nor a string
        ({"memory_mb": 2**63}, "task.memory_mb"),
        ({"image": 5}, "task.image"),  # no int for a string
        ({"env": ["A=" + "x" * 4096]}, "task.env.0"),
        ({"command": ["x" * 4097]}, "task.command.0"),
        ({"engine_args": ["-np"] * 257}, "task.engine_args"),
    ],
)
def test_types_are_strict_and_sizes_bounded(api: Api, task: dict[str, Any], field: str) -> None:
    admin = api.login()
    refused(create(api, admin, service_body(task=task)), field)
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]


def test_bool_is_not_an_int_anywhere_but_an_int_is_a_fine_float(api: Api) -> None:
    admin = api.login()
    refused(create(api, admin, service_body(enable_api=1)), "enable_api")
    refused(create(api, admin, service_body(priority=True)), "priority")
    hc = {"interval_seconds": 5, "timeout_seconds": 2, "start_period_seconds": 0}
    r = create(api, admin, service_body(health_check=hc))  # JSON ints for float fields
    assert r.status_code == 201, r.text


def test_a_log_cursor_past_32_bits_is_400_not_500(api: Api) -> None:
    admin = api.login()
    g = create(api, admin, service_body()).json()
    task_id = g["tasks"][0]["id"]
    for after in ("9223372036854775808", str(2**31), "-1", "1e3", "true"):
        r = api.client.get(f"/api/v1/tasks/{task_id}/logs?after={after}", headers=admin)
        refused(r, "after")
    ok = api.client.get(f"/api/v1/tasks/{task_id}/logs?after={2**31 - 1}", headers=admin)
    assert ok.status_code == 200 and ok.json()["chunks"] == []


@pytest.mark.parametrize("priority", [2**64, -(2**64), 2**63, 1_000_001, -1_000_001])
def test_route_priority_past_its_range_is_400(api: Api, priority: int) -> None:
    admin = api.login()
    g = create(api, admin, service_body()).json()
    before = rows(api, ModelRoute)
    body = {"model_name": "other", "group_id": g["id"], "priority": priority}
    refused(api.client.post("/api/v1/model-routes", json=body, headers=admin), "priority")
    route_id = api.client.get("/api/v1/model-routes", headers=admin).json()[0]["id"]
    r = api.client.put(
        f"/api/v1/model-routes/{route_id}", json={"priority": priority}, headers=admin
    )
    refused(r, "priority")
    assert rows(api, ModelRoute) == before


def test_64_bit_values_never_reach_the_database(api: Api) -> None:
    """Columns are 32-bit integers on PostgreSQL: every value that lands in one is
    bounded at the door (these were driver errors, i.e. 500s, on PostgreSQL)."""
    admin = api.login()
    g = create(api, admin, service_body()).json()
    ep = api.client.get("/api/v1/gateway/endpoints", headers=admin).json()[0]["id"]
    r = api.client.patch(f"/api/v1/gateway/endpoints/{ep}", json={"tpm_limit": 2**40},
                         headers=admin)
    refused(r, "tpm_limit")
    beat = {"name": "n", "address": "127.0.0.1", "inventory": {"cpu_count": 2**40}}
    r = api.client.post("/api/v1/agent/heartbeat", json=beat,
                        headers={"Authorization": f"Bearer {NODE_TOKEN}"})
    refused(r, "inventory.cpu_count")
    record = {
        "endpoint_id": ep, "tenant_id": g["tenant_id"], "model": "svc", "requests": 2**40,
        "prompt_tokens": 1, "completion_tokens": 1, "recorded_at": "2026-01-01T00:00:00Z",
    }
    gw = {"Authorization": "Bearer gw-token-for-tests"}
    r = api.client.post("/api/v1/gateway/usage", json={"records": [record]}, headers=gw)
    refused(r, "records.0.requests")
    far = {**record, "requests": 1, "recorded_at": "9999-12-31T23:59:59-05:00"}
    r = api.client.post("/api/v1/gateway/usage", json={"records": [far]}, headers=gw)
    refused(r, "records.0.recorded_at")  # an overflow in the UTC conversion, before
    r = api.client.get("/api/v1/usage?start=0001-01-01T00:00:00%2B01:00", headers=admin)
    refused(r, "start")
    node = api.heartbeat()
    fr_headers = {"Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node,
                  "X-Chunk-Seq": str(2**40)}
    r = api.client.post("/api/v1/agent/file-requests/fr-000000000000/chunks", content=b"x",
                        headers=fr_headers)
    refused(r, "x-chunk-seq")
    assert rows(api, UsageRecord, FileRequestChunk) == [0, 0]


# --- model_path: the node's volume rules, before anything is read or written ------------


@pytest.mark.parametrize(
    "path",
    [
        "/models-evil/a.gguf",  # a string prefix, not a segment prefix
        "/etc/passwd",
        "/models/../etc/passwd",  # '..' is refused, not resolved
        "/models/a/../../etc/passwd",
        "/",
    ],
)
def test_model_path_outside_the_allowed_prefixes_is_400_before_anything_is_written(
    api: Api, path: str
) -> None:
    admin = api.login()
    api.heartbeat(allowed=["/models"])
    body = service_body(task={"model_path": path})
    for dry in (True, False):
        err = refused(create(api, admin, body, dry), "task.model_path")
        assert "/models" in err["message"] or "'..'" in err["message"]
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]
    ok = create(api, admin, service_body(task={"model_path": "/models/a.gguf"}))
    assert ok.status_code == 201, ok.text


@pytest.mark.parametrize(
    ("path", "allowed", "denied", "ok"),
    [
        ("/models/a.gguf", ["/models"], [], True),
        ("/models", ["/models"], [], True),
        ("/models/a.gguf", ["/models/"], [], True),  # a trailing slash changes nothing
        ("/models//sub/./a.gguf", ["/models"], [], True),  # normalised first
        ("/models-evil/a", ["/models"], [], False),  # segment boundaries, not strings
        ("/model", ["/models"], [], False),
        ("/models/../etc/passwd", ["/models"], [], False),
        ("/anything", ["/"], [], True),
        ("/models/private/a", ["/models"], ["/models/private"], False),
        ("/models/private-not/a", ["/models"], ["/models/private"], True),
        ("models/a.gguf", ["/models"], [], False),  # relative: not this rule's to allow
        ("/models/a", [], [], False),
    ],
)
def test_the_volume_rule(path: str, allowed: list[str], denied: list[str], ok: bool) -> None:
    """One pure rule for server and agent (``core.paths.volume_allows``)."""
    assert volume_allows(path, allowed, denied) is ok


@pytest.mark.parametrize(
    ("path", "problem"),
    [("/m/a.gguf", None), ("a/b.gguf", None), ("a..b/c", None), ("/m/../x", "'..'"),
     ("..", "'..'"), ("a/..", "'..'"), ("/m/a\x00", "NUL"), ("/" + "a" * 5000, "4096")],
)
def test_model_path_form(path: str, problem: str | None) -> None:
    got = model_path_problem(path)
    assert (got is None) if problem is None else (got is not None and problem in got)


def test_denied_prefixes_and_dedicated_nodes_are_respected(api: Api) -> None:
    admin = api.login()
    bob = api.member(admin, "team-b", "bob")
    beat = {"name": "shared", "address": "127.0.0.1", "inventory": {},
            "allowed_volume_prefixes": ["/data"], "denied_volume_prefixes": ["/data/private"]}
    # a node dedicated to another tenant allows /secret: bob may not use (nor learn) it
    dedicated = {"name": "dedicated", "address": "127.0.0.1", "inventory": {},
                 "labels": {"heteroflow.tenants": "tn-000000000000"},
                 "allowed_volume_prefixes": ["/secret"]}
    for body in (beat, dedicated):
        r = api.client.post("/api/v1/agent/heartbeat", json=body,
                            headers={"Authorization": f"Bearer {NODE_TOKEN}"})
        assert r.status_code == 200, r.text
    with api.app.db.session() as s:
        n = s.scalar(select(Node).where(Node.name == "shared"))
        assert n is not None and n.denied_volume_prefixes == ["/data/private"]
    err = refused(create(api, bob, service_body(task={"model_path": "/data/private/m.gguf"})),
                  "task.model_path", "/data/private")
    err = refused(create(api, bob, service_body(task={"model_path": "/secret/m.gguf"})),
                  "task.model_path", "allowed: /data")
    assert "/secret" not in err["message"].replace("'/secret/m.gguf'", "")
    assert create(api, bob, service_body(task={"model_path": "/data/m.gguf"})).status_code == 201
    nodes = api.client.get("/api/v1/nodes", headers=bob).json()
    assert [(n["name"], n["allowed_volume_prefixes"], n["denied_volume_prefixes"])
            for n in nodes] == [("shared", ["/data"], ["/data/private"])]


def test_with_no_node_registered_absolute_paths_are_refused_and_names_are_fine(
    api: Api,
) -> None:
    admin = api.login()
    refused(create(api, admin, service_body(task={"model_path": "/models/a.gguf"})),
            "task.model_path", "no node you may use")
    for name in ("../a.gguf", "a/../../etc/passwd", ".."):
        refused(create(api, admin, service_body(task={"model_path": name})),
                "task.model_path", "'..'")
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]
    ok = create(api, admin, service_body(task={"model_path": "org/tiny.gguf"}))
    assert ok.status_code == 201, ok.text


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"task": {"model_path": "/models/a\x00.gguf"}}, "task.model_path"),
        ({"task": {"model_path": "tiny\x00"}}, "task.model_path"),
        ({"labels": {"team": "a\x00b"}}, "labels.team"),
        ({"task": {"gpu_type": "A10\x00"}}, "task.gpu_type"),
        ({"task": {"env": ["A=\x00"]}}, "task.env.0"),
        ({"task": {"engine_args": ["-c\x00"]}}, "task.engine_args.0"),
        ({"name": "svc\x00"}, "name"),
    ],
)
def test_a_nul_byte_is_400(api: Api, over: dict[str, Any], field: str) -> None:
    admin = api.login()
    api.heartbeat(allowed=["/models"])
    refused(create(api, admin, service_body(**over)), field)
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]


def raw(api: Api, who: dict[str, str], text: str) -> Any:
    """A body no JSON encoder would write (NaN, a lone surrogate escape), sent as is."""
    return api.client.post(
        "/api/v1/task-groups", content=text.encode(),
        headers={**who, "Content-Type": "application/json"},
    )


def test_nan_and_lone_surrogates_are_400(api: Api) -> None:
    admin = api.login()
    task = '"task": {"image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0}'
    refused(raw(api, admin, '{"name": "a", "priority": NaN, ' + task + "}"), "priority")
    hc = '"health_check": {"interval_seconds": Infinity}'
    refused(raw(api, admin, '{"name": "a", ' + hc + ", " + task + "}"),
            "health_check.interval_seconds")
    refused(raw(api, admin, '{"name": "a", "labels": {"k": "\\ud800"}, ' + task + "}"),
            "labels.k")
    assert rows(api, *WRITTEN) == [0, 0, 0, 0]


def test_nul_and_oversized_ids_in_paths_and_queries_are_400(api: Api) -> None:
    admin = api.login()
    for url, field in [
        ("/api/v1/task-groups/tg-%00", "group_id"),
        ("/api/v1/tasks/" + "a" * 65, "task_id"),
        ("/api/v1/tasks/task-x%00/logs", "task_id"),
        ("/api/v1/model-routes?group_id=tg%00", "group_id"),
        ("/api/v1/usage?model=a%00", "model"),
        ("/api/v1/usage?tenant_id=" + "t" * 65, "tenant_id"),
    ]:
        refused(api.client.get(url, headers=admin), field)
    body = {"task_id": "task-1", "request_type": "list", "target_path": "/a\x00"}
    refused(api.client.post("/api/v1/file-requests", json=body, headers=admin), "target_path")


def test_the_dry_run_reads_no_file_outside_the_prefixes(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimate reads GGUF headers: it must never run for a path no node allows."""
    from heteroflow.models.estimate import estimate_model_path as real
    from heteroflow.services.placement import model_files

    read: list[Path] = []

    def spy(path: Path, **kw: Any) -> Any:
        read.append(path)
        return real(path, **kw)

    monkeypatch.setattr(model_files, "estimate_model_path", spy)
    admin = api.login()
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    secret = write_tiny_gguf(outside / "secret.gguf")
    allowed = write_tiny_gguf(inside / "tiny.gguf")
    api.heartbeat(allowed=[str(inside)])
    # by path, through '..', and by a name that climbs out of the prefix (issue 33: a
    # name is looked up under the nodes' prefixes, as their agents look)
    for path in (str(secret), f"{inside}/../outside/secret.gguf", "../outside/secret.gguf"):
        for dry in (True, False):
            body = service_body(task={"model_path": path})
            err = refused(create(api, admin, body, dry), "task.model_path")
            assert "MB" not in err["message"]  # nothing of the file's header shows
    assert read == [] and rows(api, *WRITTEN) == [0, 0, 0, 0]
    plan = create(api, admin, service_body(task={"model_path": str(allowed)}), dry=True)
    assert plan.status_code == 200 and plan.json()["estimate_detail"]  # the spy is live
    assert read == [allowed]


def test_the_agent_reports_its_volume_rules_in_the_heartbeat(api: Api, tmp_path: Path) -> None:
    """The daemon's own heartbeat body carries its NodeConfig's prefixes; the server
    stores them and create checks against them."""
    config = NodeConfig(
        allowed_volume_prefixes=("/srv/models",),
        denied_volume_prefixes=("/srv/models/private",),
        model_scan_dirs=(),
    )

    class Launcher:
        runtime = type("R", (), {"name": "process"})()

        def engines(self) -> dict[str, str]:
            return {"llamacpp": ""}

        def log_source(self, task_id: str, since: str) -> tuple[str, str]:
            return "", since

    settings = AgentSettings(
        server_url="http://server", node_token=NODE_TOKEN, node_name="agent-node",
        work_dir=tmp_path / "agent",
    )
    agent = Agent(
        settings, config, Launcher(), api.clock, nvml=NvmlDiscovery(platform="none")  # type: ignore[arg-type]
    )
    inv = NodeInventory(gpus=(), cpu_count=2, memory_total_mb=4096, memory_available_mb=4096,
                        cpu_percent=1.0, memory_percent=2.0)
    body = agent._heartbeat_body(inv).model_dump(mode="json")
    asyncio.run(agent.client.aclose())
    assert body["allowed_volume_prefixes"] == ["/srv/models"]
    assert body["denied_volume_prefixes"] == ["/srv/models/private"]
    r = api.client.post("/api/v1/agent/heartbeat", json=body,
                        headers={"Authorization": f"Bearer {NODE_TOKEN}"})
    assert r.status_code == 200, r.text
    admin = api.login()
    refused(create(api, admin, service_body(task={"model_path": "/srv/models/private/a"})),
            "task.model_path")
    ok = create(api, admin, service_body(task={"model_path": "/srv/models/a.gguf"}))
    assert ok.status_code == 201, ok.text


# --- the walks: later fields stay bounded ------------------------------------------------


def _unbounded(schema: dict[str, Any], comps: dict[str, Any], where: str,
               seen: frozenset[str] = frozenset()) -> list[str]:
    """Where a request schema admits an unbounded value (string, number, list, map)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name in seen:
            return []
        seen, schema = seen | {name}, comps[name]
    out: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key, []):
            out += _unbounded(sub, comps, where, seen)
    if "enum" in schema or "const" in schema:
        return out
    kind = schema.get("type")
    if kind == "string" and "maxLength" not in schema and schema.get("format") != "date-time":
        out.append(f"{where}: string without maxLength")
    if kind in ("integer", "number"):
        low = "minimum" in schema or "exclusiveMinimum" in schema
        high = "maximum" in schema or "exclusiveMaximum" in schema
        if not (low and high):
            out.append(f"{where}: {kind} without a range")
    if kind == "array":
        if "maxItems" not in schema:
            out.append(f"{where}: array without maxItems")
        out += _unbounded(schema.get("items", {}), comps, f"{where}[]", seen)
    extra = schema.get("additionalProperties")
    values = [extra] if isinstance(extra, dict) else []
    values += list(schema.get("patternProperties", {}).values())
    if values and "maxProperties" not in schema:
        out.append(f"{where}: map without maxProperties")
    for v in values:
        out += _unbounded(v, comps, f"{where}{{}}", seen)
    if "propertyNames" in schema:
        out += _unbounded({"type": "string", **schema["propertyNames"]}, comps,
                          f"{where}{{key}}", seen)
    for name, sub in schema.get("properties", {}).items():
        out += _unbounded(sub, comps, f"{where}.{name}", seen)
    return out


def test_every_request_field_is_bounded_in_the_openapi_document(api: Api) -> None:
    """Bodies, path and query parameters: every string has a maxLength, every number a
    range, every list and map a size. (Headers come from the auth dependencies.)"""
    doc = api.client.get("/api/v1/openapi.json").json()
    comps = doc["components"]["schemas"]
    found: list[str] = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for p in op.get("parameters", []):
                if p["in"] in ("path", "query"):
                    where = f"{method.upper()} {path} {p['in']} {p['name']}"
                    found += _unbounded(p["schema"], comps, where)
            for content in op.get("requestBody", {}).get("content", {}).values():
                found += _unbounded(content["schema"], comps, f"{method.upper()} {path} body")
    assert found == []


_VALUE_SCHEMAS = ("schema", "lax_schema", "strict_schema", "json_schema", "python_schema",
                  "choices")


def _unguarded_strings(node: Any, where: str, guarded: bool = False) -> list[str]:
    """``str`` nodes of a pydantic core schema that no NUL check (``no_nul``/``scrub``/
    ``no_nul_secret``)
    wraps; in a chain, one guarded step guards the value for the others."""
    guards = (common.no_nul, common.no_nul_secret, common.scrub)
    if isinstance(node, list):
        return [x for v in node for x in _unguarded_strings(v, where, guarded)]
    if not isinstance(node, dict):
        return []
    kind = node.get("type")
    if kind == "function-after":
        mine = node.get("function", {}).get("function") in guards
        return _unguarded_strings(node.get("schema"), where, guarded or mine)
    if kind == "chain":
        steps = node.get("steps", [])
        mine = any(s.get("type") == "function-after"
                   and s.get("function", {}).get("function") in guards for s in steps)
        return [x for s in steps for x in _unguarded_strings(s, where, guarded or mine)]
    out = [where] if kind == "str" and not guarded else []
    for key, value in node.items():
        if key in ("function", "cls", "metadata", "ref"):
            continue
        # a guard around a value guards every way of reading it (a SecretStr's lax and
        # strict, JSON and Python schemas)
        inner = guarded if key in _VALUE_SCHEMAS else False
        label = where if key in ("schema", "fields") else f"{where}.{key}"
        out += _unguarded_strings(value, label, inner)
    return out


def test_every_request_string_refuses_nul() -> None:
    for info in pkgutil.iter_modules(heteroflow.schemas.__path__):
        importlib.import_module(f"heteroflow.schemas.{info.name}")
    stack, models = list(common.Strict.__subclasses__()), []
    while stack:
        m = stack.pop()
        models.append(m)
        stack += m.__subclasses__()
    assert len(models) > 15
    found = [x for m in models
             for x in _unguarded_strings(m.__pydantic_core_schema__, m.__name__)]
    assert found == []


def test_a_field_named_path_is_named_in_the_error(api: Api) -> None:
    """The error's field is the dotted path of the field: a nested field called ``path``
    (``health_check.path``) is not dropped as if it were the request's location."""
    admin = api.login()
    api.heartbeat()
    body = service_body(health_check={"path": "no-leading-slash"})
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "health_check.path"
