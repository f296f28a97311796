"""Reuse without disclosure (issue 26, item 6): tenant D reuses tenant C's service
through cross-tenant dedup, and neither learns anything of the other.

The real server and its gateway (uvicorn on a background loop, both databases) in front
of a fake engine that names its model by a path of C's (as llama.cpp and vLLM name it by
their model file), as in test_wake_on_request.py. D's create answer, dry run, lists,
usage and every gateway answer (JSON and stream: chat, completions, ``/v1/models``;
embeddings in tests/unit/test_normalize.py) carry none of C's tenant, member, group,
names, tasks, node or paths, and name the model as D called it; C's events, routes,
keys and answers carry nothing of D's. The operator sees the link.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest

from heteroflow.db.tables import Task
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import Api, service_body
from .test_dedup import agent, running, share, sleep, switches, tenant_of

ENGINE_ID = "/srv/tenant-c-private/weights/tiny.gguf"  # the engine's own name for it
MSG: list[Any] = [{"role": "user", "content": "hi"}]
GROUPS = "/api/v1/task-groups"


@dataclass
class Live:
    api: Api
    thread: UvicornThread
    port: int
    engine: FakeOpenAIBackend
    engine_port: int

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             max_retries=0, timeout=10.0)


@pytest.fixture
def live(api: Api) -> Iterator[Live]:
    thread = UvicornThread()
    engine = FakeOpenAIBackend([ENGINE_ID])
    engine_port = thread.serve(engine)
    port = thread.serve(api.app.asgi)
    try:
        yield Live(api, thread, port, engine, engine_port)
    finally:
        thread.call(api.app.gateway.aclose())
        thread.stop()


def _body(name: str, model_name: str, **over: Any) -> dict[str, Any]:
    return service_body(name=name, model_name=model_name, enable_api=True, **over)


def _answer_on(api: Api, task_id: str, port: int) -> None:
    """The task's engine is the fake one: its allocated host port becomes the fake's (a
    member cannot ask for a fixed host port; the agent would bind the allocated one)."""
    with api.app.db.session() as s:
        t = s.get(Task, task_id)
        assert t is not None and t.ports
        t.ports = [{**p, "host_port": port} for p in t.ports]


def _create(api: Api, who: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    r = api.client.post(GROUPS, json=body, headers=who)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _get(api: Api, who: dict[str, str], path: str) -> Any:
    r = api.client.get(path, headers=who)
    assert r.status_code == 200, r.text
    return r.json()


def _user_id(api: Api, admin: dict[str, str], username: str) -> str:
    users = _get(api, admin, "/api/v1/users")
    return str(next(u["id"] for u in users if u["username"] == username))


def _leaks(blob: object, secrets: dict[str, str]) -> list[str]:
    text = blob if isinstance(blob, str) else orjson.dumps(blob).decode()
    return [what for what, value in secrets.items() if value in text]


@dataclass
class Shared:
    """C's running service, reused by D; what each must never see of the other."""

    admin: dict[str, str]
    c: dict[str, str]
    d: dict[str, str]
    c_group: dict[str, Any]
    d_created: dict[str, Any]
    d_plan: dict[str, Any]
    of_c: dict[str, str]
    of_d: dict[str, str]


def _shared(lv: Live) -> Shared:
    api = lv.api
    admin = api.login()
    c = api.member(admin, "tenant-carrot", "carol")
    d = api.member(admin, "tenant-daikon", "dave")
    tc, td = tenant_of(api, c), tenant_of(api, d)
    node = api.heartbeat("node-c")
    g = _create(api, c, _body("carrot-svc", "carrot-llm", labels={"team": "carrot-label"}))
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    _answer_on(api, task_id, lv.engine_port)
    agent(api, node, task_id, "claim")
    agent(api, node, task_id, "report", status="running")
    c_task = _get(api, c, f"/api/v1/tasks/{task_id}")
    switches(api, admin, inference_dedup_enabled=True, cross_tenant_dedup_enabled=True)
    share(api, admin, tc, td)

    d_body = _body("daikon-svc", "daikon-llm")
    plan = api.client.post(f"{GROUPS}?dry_run=true", json=d_body, headers=d)
    assert plan.status_code == 200, plan.text
    created = _create(api, d, d_body)
    api.app.publisher.refresh()
    of_c = {
        "C's tenant id": tc, "C's tenant name": "tenant-carrot", "C's member": "carol",
        "C's member id": _user_id(api, admin, "carol"), "C's group id": g["id"],
        "C's service name": "carrot-svc", "C's model name": "carrot-llm",
        "C's label": "carrot-label", "C's task id": task_id, "C's node id": node,
        "C's node name": "node-c", "C's endpoint id": g["endpoint"],
        "the engine's id (a path)": ENGINE_ID,
        **{f"C's launch argument {a!r}": a for a in c_task["launch_argv"] if a.startswith("/")},
    }
    of_d = {
        "D's tenant id": td, "D's tenant name": "tenant-daikon", "D's member": "dave",
        "D's member id": _user_id(api, admin, "dave"), "D's service name": "daikon-svc",
        "D's model name": "daikon-llm", "D's endpoint id": created["endpoint"],
        "D's route id": created["dedup"]["route_id"],
    }
    return Shared(admin, c, d, g, created, plan.json(), of_c, of_d)


@pytest.mark.feature("L3", "L4")
def test_a_reusing_tenant_is_answered_with_its_own_names_and_nothing_of_the_owner(
    live: Live,
) -> None:
    lv, api = live, live.api
    sh = _shared(lv)
    r, d = sh.d_created, sh.d_created["dedup"]
    # reused (no second service), said so, in D's own names only
    assert (d["reused"], d["cross_tenant"], d["action"], d["level"]) == (
        True, True, "reused", "success")
    assert (r["id"], d["group_id"], r["tasks"], d["wake"]) == ("", "", [], [])
    assert (r["tenant_id"], r["name"], r["model_name"]) == (
        sh.of_d["D's tenant id"], "daikon-svc", "daikon-llm")
    assert r["endpoint"] == d["endpoint_id"] and r["api_key"] and r["status"] == "running"
    assert "another tenant" in d["message"] and "'daikon-llm'" in d["message"]
    assert sh.d_plan["dedup"]["message"] == d["message"]  # the dry run said the same
    assert _leaks(r, sh.of_c) == [] and _leaks(sh.d_plan, sh.of_c) == []
    # D's own reads: its route and key to the shared service, its usage, no group
    routes = _get(api, sh.d, "/api/v1/model-routes")
    assert [(x["model_name"], x["group_id"]) for x in routes] == [("daikon-llm", "")]
    keys = _get(api, sh.d, "/api/v1/gateway/endpoints")
    assert [(k["id"], k["group_id"]) for k in keys] == [(r["endpoint"], "")]
    assert _get(api, sh.d, GROUPS) == []
    changed = [  # and as D changes them
        api.client.put(f"/api/v1/model-routes/{routes[0]['id']}", json={"weight": 50},
                       headers=sh.d),
        api.client.put(f"/api/v1/gateway/endpoints/{r['endpoint']}", json={"rpm_limit": 600},
                       headers=sh.d),
    ]
    assert [(x.status_code, x.json()["group_id"]) for x in changed] == [(200, ""), (200, "")]
    for path in (f"{GROUPS}/{sh.c_group['id']}", f"{GROUPS}/{sh.c_group['id']}/events",
                 f"/api/v1/tasks/{sh.c_group['tasks'][0]['id']}",
                 f"/api/v1/tasks/{sh.c_group['tasks'][0]['id']}/logs"):
        assert api.client.get(path, headers=sh.d).status_code == 404, path  # owner's only

    # D calls it by its own name, through the real gateway: every answer says that name
    client = lv.client(r["api_key"])
    try:
        assert [m.id for m in client.models.list()] == ["daikon-llm"]
        chat = client.chat.completions.create(model="daikon-llm", messages=MSG)
        chunks = list(client.chat.completions.create(
            model="daikon-llm", messages=MSG, stream=True))
        text = client.completions.create(model="daikon-llm", prompt="say")
        parts = list(client.completions.create(model="daikon-llm", prompt="say", stream=True))
    finally:
        client.close()
    assert lv.engine.received_models[-1] == ENGINE_ID  # the engine knows it by its own id
    assert chat.choices[0].message.content and chunks and parts
    assert {chat.model, text.model} == {"daikon-llm"}  # embeddings: test_normalize.py
    assert {c.model for c in chunks} == {c.model for c in parts} == {"daikon-llm"}
    for stream in (True, False):  # and the bytes on the wire, stream and not
        raw = httpx.post(
            f"http://127.0.0.1:{lv.port}/v1/chat/completions",
            json={"model": "daikon-llm", "messages": MSG, "stream": stream},
            headers={"Authorization": f"Bearer {r['api_key']}"}, timeout=10,
        )
        assert raw.status_code == 200 and '"model":"daikon-llm"' in raw.text
        assert _leaks(raw.text, sh.of_c) == [], raw.text

    # D's usage by service: its tokens, not whose service answered them
    lv.thread.call(api.app.usage.flush())
    usage = _get(api, sh.d, "/api/v1/usage?group_by=service,model")
    assert [(u["service_id"], u["model"]) for u in usage["rows"]] == [("", "daikon-llm")]
    assert usage["rows"][0]["requests"] == 6
    assert _leaks([routes, keys, usage], sh.of_c) == []


@pytest.mark.feature("L3", "L4")
def test_the_owner_learns_nothing_of_the_reusing_tenant_and_the_operator_sees_the_link(
    live: Live,
) -> None:
    lv, api = live, live.api
    sh = _shared(lv)
    gid = sh.c_group["id"]
    events = _get(api, sh.c, f"{GROUPS}/{gid}/events")
    reuse = [e for e in events if e["kind"] == "group.dedup_reused"]
    assert [e["message"] for e in reuse] == [
        "reused (dedup) by another tenant of its sharing group: reused"]
    c_reads = [
        events, _get(api, sh.c, f"{GROUPS}/{gid}"), _get(api, sh.c, GROUPS),
        _get(api, sh.c, "/api/v1/model-routes"), _get(api, sh.c, "/api/v1/gateway/endpoints"),
        _get(api, sh.c, f"/api/v1/tasks/{sh.c_group['tasks'][0]['id']}"),
    ]
    assert _leaks(c_reads, sh.of_d) == []
    # C's own answers name the model as C calls it (the engine's id stays unseen too)
    client = lv.client(sh.c_group["api_key"])
    try:
        answer = client.chat.completions.create(model="carrot-llm", messages=MSG)
        chunks = list(client.chat.completions.create(
            model="carrot-llm", messages=MSG, stream=True))
    finally:
        client.close()
    assert {answer.model, *(c.model for c in chunks)} == {"carrot-llm"}
    # the operator sees who reuses what: the routes to C's service, every tenant's
    routes = _get(api, sh.admin, f"/api/v1/model-routes?group_id={gid}")
    assert sorted((x["tenant_id"], x["model_name"]) for x in routes) == sorted([
        (sh.of_c["C's tenant id"], "carrot-llm"), (sh.of_d["D's tenant id"], "daikon-llm")])
    keys = _get(api, sh.admin, "/api/v1/gateway/endpoints")
    assert {k["group_id"] for k in keys} == {gid}


@pytest.mark.feature("L2", "L4")
def test_a_wake_for_another_tenant_is_told_by_its_branch_and_names_no_one(api: Api) -> None:
    admin = api.login()
    c = api.member(admin, "tenant-carrot", "carol")
    d = api.member(admin, "tenant-daikon", "dave")
    tc, td = tenant_of(api, c), tenant_of(api, d)
    first = running(api, c, node="node-c", name="carrot-svc", model_name="carrot-llm")
    sleep(api, c, first["task_id"])
    switches(api, admin, inference_dedup_enabled=True, cross_tenant_dedup_enabled=True)
    share(api, admin, tc, td)
    of_c = {"C's tenant": tc, "C's group": first["id"], "C's task": first["task_id"],
            "C's node": first["node_id"], "C's node name": "node-c", "C's member": "carol",
            "C's service": "carrot-svc", "C's model name": "carrot-llm"}
    # its node is away: the wake must wait, and D is told why without where
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    late = _create(api, d, service_body(name="daikon-late", model_name="daikon-llm"))
    assert (late["dedup"]["action"], late["dedup"]["wake"]) == ("wake_requested", [])
    assert "its node is offline" in late["dedup"]["message"]
    assert _leaks(late, of_c) == []
    # back, and woken by D's next create: the owner's events name no one of D's
    api.heartbeat("node-c")
    woken = _create(api, d, service_body(name="daikon-again", model_name="daikon-llm-2"))
    assert (woken["dedup"]["action"], woken["status"]) == ("woken", "waking")
    assert _leaks(woken, of_c) == []
    events = _get(api, c, f"{GROUPS}/{first['id']}/events")
    assert any("a create by another tenant of its sharing group" in e["message"]
               for e in events if e["to_status"] == "waking")
    of_d = {"D's tenant": td, "D's member": "dave", "D's names": "daikon",
            "D's endpoint": late["endpoint"]}
    assert _leaks(events, of_d) == []
