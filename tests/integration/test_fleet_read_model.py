"""One read model of the fleet (issue 11): a create, its dry run, the memory precheck and
a scheduler round judge the nodes the same way — online by ``node_offline_after_s``,
with the engines, cards and bookings of one read (``services.fleet.read_fleet``).

The fake clock moves between the heartbeat and the request here: a create that read
the nodes with a window of its own (it once used 0 s) answers differently from its dry
run as soon as the heartbeat is one second old.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, func, select

from heteroflow.core.placement import NodeView, never_fits
from heteroflow.db.tables import InferenceEndpoint, Task, TaskGroup
from heteroflow.services.lifecycle import task_groups
from heteroflow.services.placement import (
    dry_run,
    fleet,
    model_files,
    one_click,
    placer,
    planning,
    scheduling,
)

from .conftest import NODE_TOKEN, Api, service_body

LLAMACPP_IMAGE = "ghcr.io/ggml-org/llama.cpp:server"


def heartbeat(api: Api, name: str = "cpu-node", engines: dict[str, str] | None = None) -> str:
    """A CPU node whose probe reports llama.cpp (the one-click chain of a GPU-less node)."""
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name,
            "address": "127.0.0.1",
            "runtime": "docker",
            "engines": {"llamacpp": LLAMACPP_IMAGE} if engines is None else engines,
            "allowed_volume_prefixes": ["/data/models"],
            "inventory": {"gpus": [], "cpu_count": 8, "memory_total_mb": 65536},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def one_click_body(name: str = "oc") -> dict[str, Any]:
    """No task.image: the create takes the first template an online node reports (H2)."""
    return service_body(name=name, task={"image": "", "gpu_required": 0})


def window(api: Api) -> float:
    return api.app.settings.node_offline_after_s


def count(api: Api, table: type) -> int:
    with api.app.db.session() as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


AGES: dict[str, Callable[[float], float]] = {
    "1s": lambda w: 1,
    "5s": lambda w: 5,
    "window-1s": lambda w: w - 1,
    "window": lambda w: w,  # the window itself is still online (last >= now - window)
}


@pytest.mark.feature("H2")
@pytest.mark.parametrize("age", list(AGES))
def test_one_click_create_and_dry_run_both_succeed_within_the_window(
    api: Api, age: str
) -> None:
    admin = api.login()
    node_id = heartbeat(api)
    api.clock.advance(AGES[age](window(api)))
    plan = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=one_click_body(), headers=admin
    )
    assert plan.status_code == 200, plan.text
    assert (plan.json()["engine"], plan.json()["image"]) == ("llamacpp", LLAMACPP_IMAGE)
    assert plan.json()["tasks"][0]["placement"]["node_id"] == node_id
    r = api.client.post("/api/v1/task-groups", json=one_click_body(), headers=admin)
    assert r.status_code == 201, r.text
    t = r.json()["tasks"][0]
    assert (t["engine"], t["image"], t["gpu_required"]) == ("llamacpp", LLAMACPP_IMAGE, 0)
    assert t["engine_reason"] == plan.json()["engine_reason"]
    assert api.app.scheduler.run_round().placed == 1  # and the round agrees it is online
    got = api.client.get(f"/api/v1/tasks/{t['id']}", headers=admin).json()
    assert got["node_id"] == node_id


@pytest.mark.feature("H2")
def test_past_the_window_create_and_dry_run_refuse_alike(api: Api) -> None:
    admin = api.login()
    heartbeat(api)
    api.clock.advance(window(api) + 1)
    plan = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=one_click_body(), headers=admin
    )
    r = api.client.post("/api/v1/task-groups", json=one_click_body(), headers=admin)
    assert (plan.status_code, r.status_code) == (400, 400), (plan.text, r.text)
    assert plan.json()["error"] == r.json()["error"]
    assert r.json()["error"]["field"] == "task.image"
    assert "no online node" in r.json()["error"]["message"]
    assert [count(api, t) for t in (TaskGroup, Task, InferenceEndpoint)] == [0, 0, 0]
    # the node comes back: both answer again
    heartbeat(api)
    plan = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=one_click_body(), headers=admin
    )
    r = api.client.post("/api/v1/task-groups", json=one_click_body(), headers=admin)
    assert (plan.status_code, r.status_code) == (200, 201), (plan.text, r.text)


def test_dry_run_reason_and_the_first_scheduler_reason_agree_about_offline(api: Api) -> None:
    admin = api.login()
    node_id = heartbeat(api)
    body = service_body()  # names its image: an offline fleet means wait, not refuse
    api.clock.advance(window(api) + 1)
    plan = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
    assert plan.status_code == 200, plan.text
    planned = plan.json()["tasks"][0]
    assert planned["placement"] is None and "offline" in planned["pending_reason"]
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    task_id = r.json()["tasks"][0]["id"]
    assert api.app.scheduler.run_round().placed == 0
    t = api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()
    assert t["status"] == "pending"
    assert t["status_message"] == planned["pending_reason"]
    # one second inside the window: the dry run shows the node and the round takes it
    heartbeat(api)
    api.clock.advance(window(api) - 1)
    plan = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=service_body(name="svc2"), headers=admin
    )
    assert plan.json()["tasks"][0]["placement"]["node_id"] == node_id
    assert api.app.scheduler.run_round().placed == 1
    t = api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()
    assert (t["status"], t["node_id"]) == ("scheduled", node_id)


@contextmanager
def node_selects(api: Api) -> Iterator[list[str]]:
    """The SELECTs on the nodes table run while the block runs."""
    seen: list[str] = []

    def record(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        s = " ".join(statement.split()).lower()
        if s.startswith("select") and " from nodes" in s:
            seen.append(s)

    eng = api.app.db.engine
    event.listen(eng, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(eng, "before_cursor_execute", record)


def test_create_dry_run_precheck_and_round_read_the_one_fleet(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each create, dry run and round reads the fleet once, with the setting's window,
    and planning (one-click engines, the memory precheck) and the round's engine chain
    work on the very views that read returned — no second reader of the nodes."""
    admin = api.login()
    heartbeat(api)
    heartbeat(api, "bare", engines={})
    reads: list[tuple[str, float, fleet.Fleet]] = []

    def spy(where: str) -> Callable[..., fleet.Fleet]:
        def read(*args: Any, **kw: Any) -> fleet.Fleet:
            f = fleet.read_fleet(*args, **kw)
            reads.append((where, float(args[2] if len(args) > 2 else kw["offline_after_s"]), f))
            return f
        return read

    for mod in (task_groups, dry_run, scheduling):
        monkeypatch.setattr(mod, "read_fleet", spy(mod.__name__.rsplit(".", 1)[1]))
    used: list[tuple[str, list[NodeView]]] = []
    chain_of = fleet.engines_of

    def planning_engines(n: NodeView) -> Any:
        used.append(("one_click", [n]))
        return chain_of(n)

    def precheck(d: Any, nodes: list[NodeView], res: Any) -> str:
        used.append(("precheck", list(nodes)))
        return never_fits(d, nodes, res)

    def round_engines(n: NodeView) -> Any:
        used.append(("round", [n]))
        return chain_of(n)

    monkeypatch.setattr(one_click, "engines_of", planning_engines)
    monkeypatch.setattr(planning, "never_fits", precheck)
    monkeypatch.setattr(placer, "engines_of", round_engines)  # the round's chain (H1)
    monkeypatch.setattr(model_files, "estimate", lambda *_: _ESTIMATE)  # runs the precheck
    api.clock.advance(window(api) - 1)

    def views_of(i: int) -> set[int]:
        return {id(v) for v in reads[i][2].views.values()}

    with node_selects(api) as sql:
        plan = api.client.post(
            "/api/v1/task-groups?dry_run=true", json=one_click_body(), headers=admin
        )
    assert plan.status_code == 200, plan.text
    assert [(w, o) for w, o, _ in reads] == [("dry_run", window(api))]
    assert {k for k, _ in used} == {"one_click", "precheck"}
    assert all(id(n) in views_of(0) for _, ns in used for n in ns)
    # the fleet read is the only one: the placed node's address comes with its view
    assert any(t["placement"] for t in plan.json()["tasks"])
    assert len(sql) == 1, sql

    used.clear()
    with node_selects(api) as sql:
        r = api.client.post("/api/v1/task-groups", json=one_click_body(), headers=admin)
    assert r.status_code == 201, r.text
    assert [(w, o) for w, o, _ in reads[1:]] == [("task_groups", window(api))]
    assert {k for k, _ in used} == {"one_click", "precheck"}
    assert all(id(n) in views_of(1) for _, ns in used for n in ns)
    assert len(sql) == 1, sql

    # a task that names no engine: the round's chain (H1) reads the round's views
    named = service_body(name="chain", task={"image": "myorg/server:1", "gpu_required": 1})
    r = api.client.post("/api/v1/task-groups", json=named, headers=admin)
    assert r.status_code == 201, r.text
    used.clear()
    with node_selects(api) as sql:
        assert api.app.scheduler.run_round().placed == 1  # the one-click task
    assert [(w, o) for w, o, _ in reads[3:]] == [("scheduling", window(api))]
    assert [k for k, _ in used] == ["round", "round"]  # both nodes, once per image
    assert all(id(n) in views_of(3) for _, ns in used for n in ns)
    assert len(sql) == 1, sql


class _Estimate:
    total_mb = 512
    detail = "512 MB (test)"


_ESTIMATE: Any = _Estimate()
