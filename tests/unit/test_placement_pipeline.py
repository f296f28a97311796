"""B1 pipeline pieces: load threshold, inference container cap, locality, engine preference."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.placement import (
    CardView,
    FleetIndex,
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
    for n in (plain, engine, local):  # C4: each node's volume rule allows the path
        n.allowed_volume_prefixes = ("/data/models",)
    d = demand(model_path="/data/models/qwen", engine="vllm", estimated_gpu_memory_mb=1000)
    assert place(d, [plain, engine, local], RES, POOL).node_id == "c-local"  # type: ignore[union-attr]
    assert place(d, [plain, engine], RES, POOL).node_id == "b-engine"  # type: ignore[union-attr]
    allows = node("d", allowed_volume_prefixes=("/data",))
    assert place(d, [plain, allows], RES, POOL).node_id == "a-plain"  # type: ignore[union-attr]
    # a node whose rule refuses the path is never chosen (its agent would refuse it)
    assert place(d, [node("e"), allows], RES, POOL).node_id == "d"  # type: ignore[union-attr]


def cpu_node(name: str, **kw: Any) -> NodeView:
    return NodeView(id=name, name=name, online=True, cards=[], cpu_count=2,
                    memory_total_mb=24576, **kw)


@pytest.mark.feature("B1")
def test_other_programs_load_never_strands_a_cpu_engine() -> None:
    """Issue 12: the load threshold gates GPU work; a CPU engine on a busy one-machine
    install is admitted by the memory really free there, and told why when there is none."""
    cpu = demand(gpu_required=0, memory_mb=1024)
    busy = cpu_node("laptop", cpu_percent=99.0, memory_percent=95.0, memory_available_mb=2048)
    for nodes in ([busy], FleetIndex([busy], load_threshold_pct=90).order(cpu)):
        got = place(cpu, nodes, RES, POOL, Policy(load_threshold_pct=90))
        assert isinstance(got, Placement) and got.node_id == "laptop", got
    # what other programs hold is not free: 2 GB free, 1 GB booked by a placed engine
    # that has not loaded yet -> a second 1.5 GB engine does not fit
    book(busy, Placement("laptop", (), 0, 1024, (20000,)), cpu)
    assert busy.memory_unloaded_mb == 1024
    big = demand(gpu_required=0, memory_mb=1536)
    short = place(big, [busy], RES, POOL, Policy(load_threshold_pct=90))
    assert isinstance(short, Unplaced) and "not 1536 MB of free memory" in short.reason
    # a loaded engine's memory is already out of the reported free memory: not twice
    loaded = cpu_node("box", memory_available_mb=2048)
    book(loaded, Placement("box", (), 0, 1024, (20000,)), cpu, loaded=True)
    assert isinstance(place(big, [loaded], RES, POOL), Placement)
    # GPU work still skips a node over the threshold
    gpu = place(demand(), [node("hot", cpu_percent=95.0)], RES, POOL, Policy())
    assert isinstance(gpu, Unplaced) and "CPU or memory use above 90%" in gpu.reason
