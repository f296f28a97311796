"""B1 pipeline pieces: load threshold, inference container cap, locality, engine preference."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.placement import (
    CardView,
    NodeView,
    Placement,
    Policy,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
    place,
)

RES = Reservation()
POOL = range(20000, 20010)


def node(name: str, **kw: Any) -> NodeView:
    cards = [CardView(0, "nvidia", "A10", 24576)]
    return NodeView(
        id=name, name=name, online=True, cards=cards, cpu_count=8, memory_total_mb=65536, **kw
    )


def demand(**kw: object) -> TaskDemand:
    base: dict[str, object] = dict(
        task_id="t",
        gpu_required=1,
        gpu_type="",
        gpu_memory_utilization=10,
        estimated_gpu_memory_mb=0,
        memory_mb=0,
        host_ports=(0,),
        task_type="inference",
    )
    base.update(kw)
    return TaskDemand(**base)  # type: ignore[arg-type]


@pytest.mark.feature("B1", "B5")
def test_busy_nodes_are_skipped_with_a_reason() -> None:
    hot = node("hot", cpu_percent=95.0)
    full_mem = node("mem", memory_percent=91.0)
    r = place(demand(), [hot, full_mem], RES, POOL, Policy(load_threshold_pct=90))
    assert isinstance(r, Unplaced)
    assert "2 node(s): CPU or memory use above 90%" in r.reason
    ok = place(demand(), [hot, node("calm", cpu_percent=50.0)], RES, POOL)
    assert isinstance(ok, Placement) and ok.node_id == "calm"


@pytest.mark.feature("B1", "B5")
def test_inference_container_cap_counts_and_non_inference_work_passes() -> None:
    n = node("n", inference_tasks=2)
    r = place(demand(), [n], RES, POOL, Policy(inference_cap=2))
    assert isinstance(r, Unplaced) and "already 2 inference containers" in r.reason
    assert isinstance(
        place(demand(task_type="container"), [n], RES, POOL, Policy(inference_cap=2)), Placement
    )
    m = node("m", inference_tasks=1)
    d = demand()
    p = place(d, [m], RES, POOL, Policy(inference_cap=2))
    assert isinstance(p, Placement)
    book(m, p, d)
    assert m.inference_tasks == 2
    assert isinstance(place(demand(), [m], RES, POOL, Policy(inference_cap=2)), Unplaced)


@pytest.mark.feature("B1")
def test_model_locality_then_engine_preference_then_binpack() -> None:
    plain = node("a-plain")
    plain.cards[0].committed_mb = 20000  # binpack alone would pick this fuller node
    engine = node("b-engine", engines=frozenset({"vllm"}))
    local = node("c-local", models=frozenset({"/data/models/qwen"}))
    d = demand(model_path="/data/models/qwen", engine="vllm", estimated_gpu_memory_mb=1000)
    assert place(d, [plain, engine, local], RES, POOL).node_id == "c-local"  # type: ignore[union-attr]
    assert place(d, [plain, engine], RES, POOL).node_id == "b-engine"  # type: ignore[union-attr]
    assert place(d, [plain, node("d")], RES, POOL).node_id == "a-plain"  # type: ignore[union-attr]
