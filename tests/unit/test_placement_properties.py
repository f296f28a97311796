"""Property-based invariants of placement (B4-B6, G1), over random fleets and queues.

Whatever the fleet and the order of demands, after placing them one by one through the
fleet index (as a scheduler round does): no card is over-committed in memory or
commitment, no card holds two tenants' (share keys') work, whole-card work never shares,
inference never sits beside non-inference, and a gang is placed whole or not at all.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heteroflow.core.placement import (
    CardView,
    FleetIndex,
    NodeView,
    Placement,
    Reservation,
    TaskDemand,
    book,
    place,
    place_gang,
)

RES = Reservation()
POOL = range(20000, 20500)

card_st = st.builds(
    lambda model, total, used: (model, total, used),
    st.sampled_from(["H100", "A10"]),
    st.sampled_from([24576, 81920]),
    st.sampled_from([0, 0, 2000, 10000]),
)
node_st = st.lists(card_st, min_size=0, max_size=4)
demand_st = st.builds(
    lambda i, gpus, pct, est, kind, tenant, gtype: TaskDemand(
        task_id=f"t{i}", gpu_required=gpus, gpu_type=gtype, gpu_memory_utilization=pct,
        estimated_gpu_memory_mb=est, memory_mb=512, host_ports=(0,), task_type=kind,
        share_key=tenant,
    ),
    st.integers(0, 10**6),
    st.sampled_from([0, 1, 1, 1, 2, 3]),
    st.sampled_from([10, 30, 50, 90, 100]),
    st.sampled_from([0, 4000, 20000, 70000]),
    st.sampled_from(["inference", "inference", "training", "container"]),
    st.sampled_from(["ta", "tb", "tc"]),
    st.sampled_from(["", "", "H100", "A10"]),
)


def build(fleet: list[list[tuple[str, int, int]]]) -> list[NodeView]:
    return [
        NodeView(
            id=f"n{i}", name=f"n{i}", online=True,
            cards=[CardView(j, "nvidia", m, total, used) for j, (m, total, used) in enumerate(cs)],
            cpu_count=8, memory_total_mb=65536,
        )
        for i, cs in enumerate(fleet)
    ]


def check_invariants(nodes: list[NodeView], booked: list[tuple[TaskDemand, Placement]]) -> None:
    per_card: dict[tuple[str, int], list[tuple[TaskDemand, Placement]]] = defaultdict(list)
    for d, p in booked:
        assert len(p.gpu_ids) == d.gpu_required and len(set(p.gpu_ids)) == d.gpu_required
        for g in p.gpu_ids:
            per_card[(p.node_id, g)].append((d, p))
    cards = {(n.id, c.index): c for n in nodes for c in n.cards}
    for key, holders in per_card.items():
        c = cards[key]
        assert all(not d.gpu_type or d.gpu_type == c.model for d, _ in holders)
        assert len({d.share_key for d, _ in holders}) == 1, "two tenants on one card"
        if any(d.whole for d, _ in holders):
            assert len(holders) == 1, "whole-card work shares a card"
        assert len({d.inference for d, _ in holders}) == 1, "inference beside other work"
        assert sum(p.per_card_pct for _, p in holders) <= 100
        est = sum(d.estimated_gpu_memory_mb for d, _ in holders)
        if est:  # every estimate was admitted against what the card had left
            assert est <= c.memory_total_mb - RES.of(c.memory_total_mb)


@pytest.mark.feature("B6")
@pytest.mark.feature("B5")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=st.lists(node_st, min_size=1, max_size=6), queue=st.lists(demand_st, max_size=40))
def test_no_overcommit_no_tenant_mix_no_kind_mix(
    fleet: list[list[tuple[str, int, int]]], queue: list[TaskDemand]
) -> None:
    nodes = build(fleet)
    index = FleetIndex(nodes)
    booked: list[tuple[TaskDemand, Placement]] = []
    for n, d in enumerate(queue):
        d = dataclasses.replace(d, task_id=f"q{n}")
        r = place(d, index.order(d), RES, POOL)
        if isinstance(r, Placement):
            node = index.by_id[r.node_id]
            book(node, r, d)
            index.update(node)
            booked.append((d, r))
    check_invariants(nodes, booked)


@pytest.mark.feature("G1")
@settings(max_examples=100, deadline=None)
@given(
    fleet=st.lists(node_st, min_size=1, max_size=5),
    stages=st.integers(2, 5),
    gpus=st.integers(1, 3),
)
def test_a_gang_is_never_split(
    fleet: list[list[tuple[str, int, int]]], stages: int, gpus: int
) -> None:
    nodes = build(fleet)
    before = [(c.committed_pct, c.holders) for n in nodes for c in n.cards]
    gang = [
        TaskDemand(f"s{i}", gpus, "", 100, 0, 512, (0,), task_type="training", share_key="ta",
                   multi_node=True)
        for i in range(stages)
    ]
    r = place_gang(gang, nodes, RES, POOL)
    assert [(c.committed_pct, c.holders) for n in nodes for c in n.cards] == before
    if isinstance(r, list):
        assert len(r) == stages
        for d, p in zip(gang, r, strict=True):
            book(next(n for n in nodes if n.id == p.node_id), p, d)
        check_invariants(nodes, list(zip(gang, r, strict=True)))
        free_total = sum(1 for n in build(fleet) for c in n.cards)
        assert stages * gpus <= free_total
