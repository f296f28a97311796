"""The dry run places as the scheduler does (issue 27): on random fleets of 5-12 nodes
with mixed cards (vendors, memory, counts, some nodes over the load threshold, some
cards already booked by earlier services) and a random request, the dry run's node and
cards for each task are what a create followed by one scheduler round then writes; a
task the dry run cannot place stays queued with the pending reason it showed; and a
request the dry run refuses, the create refuses with the same answer.

Before issue 27 the dry run scanned the nodes in name order while the round walked its
ranked index and stopped after ``Policy.sample`` nodes; on 300 such fleets the two chose
different nodes in 81.

One server serves every example: an example first moves the clock past
``node_offline_after_s``, so the nodes of the examples before it are offline (they can
only add to a reason, never win), and deletes its groups at the end, so nothing of it
waits in the queue of the next. Deterministic: ``derandomize=True``, no example store,
and no shrinking (each example of a shrink adds its fleet to the one server: minutes);
a failure shows the example as drawn.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from .conftest import NODE_TOKEN, Api

EXAMPLES = 40
VLLM = "vllm/vllm-openai:v0.11.2"
LLAMACPP = "ghcr.io/ggml-org/llama.cpp:server"
MINDIE = "ascendhub/mindie:2.2.rc1"
UNNAMED = "example.org/serving:1"  # names no engine: the node's chain picks one (H1)
SHARED_MODEL = "shared-model"  # reported by some nodes: model locality ranks them first

# vendor -> (card models, the engines its nodes report)
KINDS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "nvidia": (("A100", "H100", "T4"), {"vllm": VLLM, "llamacpp": LLAMACPP}),
    "amd": (("MI300X",), {"vllm": VLLM}),
    "ascend": (("910B",), {"mindie": MINDIE}),
    "": ((), {"llamacpp": LLAMACPP}),  # a CPU-only node
}


@dataclass(frozen=True)
class NodeSpec:
    vendor: str
    model: str
    memory_mb: int
    cards: int
    busy: bool  # over the load threshold: GPU work is not placed there
    has_model: bool


@st.composite
def nodes(draw: st.DrawFn) -> NodeSpec:
    vendor = draw(st.sampled_from(["nvidia", "nvidia", "amd", "ascend", ""]))
    models = KINDS[vendor][0]
    return NodeSpec(
        vendor=vendor,
        model=draw(st.sampled_from(models)) if models else "",
        memory_mb=draw(st.sampled_from([16384, 24576, 40960, 81920])),
        cards=draw(st.integers(1, 8)) if vendor else 0,
        busy=draw(st.integers(0, 5)) == 0,
        has_model=draw(st.booleans()),
    )


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    """A request of one of the shapes the round treats differently: an engine named,
    an image whose engine the node picks, a custom command, a CPU engine, a gang."""
    kind = draw(st.sampled_from(["vllm", "vllm", "unnamed", "mindie", "command", "cpu", "gang"]))
    gpus = draw(st.integers(1, 4))
    task: dict[str, Any] = {
        "model_path": draw(st.sampled_from([SHARED_MODEL, "own-model"])),
        "estimated_gpu_memory_mb": draw(st.sampled_from([0, 8000, 20000, 60000])),
        "gpu_type": draw(st.sampled_from(["", "", "", "A100", "H100", "T4", "MI300X"])),
    }
    body: dict[str, Any] = {
        "gpu_memory_utilization": draw(st.sampled_from([30, 45, 90, 100])),
        "priority": draw(st.sampled_from([0, 0, 50])),
    }
    # rules of the group as written (bounds, run timeout): refused by both, or neither
    body |= draw(st.sampled_from([{}, {}, {}, {"max_replicas": 2}, {"run_timeout_seconds": 60}]))
    shape = draw(st.sampled_from(["single", "split", "tensor_parallel"]))
    if shape != "single":
        body |= {"parallelism": shape, "world_size": draw(st.integers(2, 3))}
    if kind == "vllm":
        task |= {"image": VLLM, "engine": "vllm", "gpu_required": gpus}
    elif kind == "unnamed":
        task |= {"image": UNNAMED, "gpu_required": gpus}
    elif kind == "mindie":
        task |= {"image": MINDIE, "engine": "mindie", "gpu_required": gpus}
    elif kind == "command":
        task |= {"image": "busybox:1.36", "command": ["sleep", "1"], "gpu_required": gpus}
        body["task_type"] = "container"
    elif kind == "cpu":
        task |= {"image": LLAMACPP, "engine": "llamacpp", "gpu_required": 0,
                 "gpu_type": "", "memory_mb": draw(st.sampled_from([0, 2048, 12000]))}
        body.pop("parallelism", None), body.pop("world_size", None)
    else:  # pipeline stages: placed all or nothing (G1)
        task |= {"image": "busybox:1.36", "command": ["sleep", "1"], "gpu_required": gpus}
        body |= {"task_type": "training", "parallelism": "pipeline",
                 "world_size": draw(st.integers(2, 3))}
    return body | {"task": task}


_example = itertools.count()


def _heartbeat(api: Api, name: str, n: NodeSpec) -> None:
    cards = [
        {"index": i, "vendor": n.vendor, "model": n.model, "memory_total_mb": n.memory_mb,
         "compute_capability": "9.0" if n.vendor == "nvidia" else None}
        for i in range(n.cards)
    ]
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name,
            "address": "127.0.0.1",
            "runtime": "docker",
            "engines": KINDS[n.vendor][1],
            "models": [{"name": SHARED_MODEL}] if n.has_model else [],
            "inventory": {"gpus": cards, "cpu_count": 8, "memory_total_mb": 32768,
                          "memory_available_mb": 32768,
                          "cpu_percent": 97.0 if n.busy else 10.0},
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text


def _placed(api: Api, admin: dict[str, str], group_id: str) -> list[dict[str, Any]]:
    r = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin)
    assert r.status_code == 200, r.text
    return sorted(r.json()["tasks"], key=lambda t: t["rank"])


def _create(api: Api, admin: dict[str, str], body: dict[str, Any]) -> Any:
    return api.client.post("/api/v1/task-groups", json=body, headers=admin)


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],  # no shrinking: minutes on one server
)
@given(
    fleet=st.lists(nodes(), min_size=5, max_size=12),
    earlier=st.lists(requests(), max_size=3),
    request=requests(),
)
def test_the_dry_run_places_each_task_where_the_round_then_does(
    api: Api, fleet: list[NodeSpec], earlier: list[dict[str, Any]], request: dict[str, Any]
) -> None:
    k = next(_example)
    api.clock.advance(api.app.settings.node_offline_after_s + 1)  # earlier fleets: offline
    admin = api.login()
    for i, n in enumerate(fleet):
        _heartbeat(api, f"e{k:03d}-{i:02d}", n)
    groups: list[str] = []
    # some cards already booked (whole or shared): what earlier services hold
    for j, body in enumerate(earlier):
        r = _create(api, admin, {"name": f"bg{k}-{j}", **body})
        if r.status_code == 201:
            groups.append(r.json()["id"])
    api.app.scheduler.run_round()

    body = {"name": f"svc{k}", **request}
    shown = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
    created = _create(api, admin, body)
    if shown.status_code != 200:  # refused: the create refuses it the same way
        event("refused")
        assert (created.status_code, created.json()) == (shown.status_code, shown.json())
    else:
        assert created.status_code == 201, created.text
        groups.append(created.json()["id"])
        api.app.scheduler.run_round()
        planned = shown.json()["tasks"]
        tasks = _placed(api, admin, created.json()["id"])
        assert len(tasks) == len(planned)
        for p, t in zip(planned, tasks, strict=True):
            where = p["placement"]
            event("a task placed" if where else "a task left pending")
            if where is None:
                assert t["status"] == "pending", (p, t)
                # a gang's reason names its member: the dry run's placeholder id
                said = t["status_message"]
                for other in tasks:
                    said = said.replace(other["id"], f"planned-{other['rank']}")
                assert said == p["pending_reason"]
            else:
                assert (t["node_id"], t["gpu_ids"]) == (where["node_id"], where["gpu_ids"]), (
                    p, t,
                )
    for g in groups:
        r = api.client.delete(f"/api/v1/task-groups/{g}", headers=admin)
        assert r.status_code == 204, r.text


def test_the_dry_run_refuses_what_the_create_refuses_of_the_group(api: Api) -> None:
    """The rules a create once asked only as it wrote the group — no run timeout for an
    inference service whose type is inferred, the replica bounds, the schedule window's
    rules for the group — are the plan's (issue 27): the dry run answers the same 400."""
    admin = api.login()
    api.heartbeat("n1", gpus=[{"index": 0, "vendor": "nvidia", "model": "A100",
                               "memory_total_mb": 81920}])
    base: dict[str, Any] = {
        "name": "svc", "task": {"image": VLLM, "model_path": "m", "gpu_required": 1}
    }
    pause = {"start": "09:00", "end": "17:00", "action": "pause"}
    job = {"task_type": "training", "schedule_window": pause,
           "task": {"image": "busybox:1.36", "command": ["sleep", "1"], "gpu_required": 1}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"run_timeout_seconds": 60}, "run_timeout_seconds"),
        ({"min_replicas": 3}, "min_replicas"),
        (job, "schedule_window.action"),
    ]
    for extra, field in cases:
        body = base | extra
        shown = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
        created = _create(api, admin, body)
        assert shown.status_code == 400, shown.text
        assert shown.json()["error"]["field"] == field, shown.text
        assert (created.status_code, created.json()) == (400, shown.json())
