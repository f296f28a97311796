"""The scheduler's shortcuts at 10,000 nodes change no decision (B1, B3, B4).

The fleet index walks last the card models that cannot hold a task's estimate once the
B3 reservation is kept free, skips (until the tail) nodes whose partly booked cards of
the task's tenant have no commitment or memory left, and explains a failure by card
model sets instead of node by node; preemption looks only at the nodes it would not
skip at once and stops trying a node when it cannot beat the plan in hand or when
moving every candidate victim would still not make room. Each is checked here against
the plain algorithm over random fleets and queues: same placements, same reasons, same
victims. A round also pauses Python's cyclic collector and leaves it as it found it.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heteroflow.controllers.scheduler import gc_paused
from heteroflow.core.placement import (
    CardView,
    FleetIndex,
    NodeView,
    Occupant,
    Placement,
    Policy,
    Preemption,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
    evaluate,
    place,
    plan_preemption,
    unbook_occupant,
)
from heteroflow.core.placement.fleet import Tally
from heteroflow.core.placement.preemption import _could_fit, _trim, may_preempt

RES = Reservation()
POOL = range(20000, 20400)
POLICY = Policy(inference_cap=3)
# card models whose sizes sit around the estimates below, the reservation included:
# 15,360 MB holds 14,000 raw but not after 500 + 10 %
MODELS = {"T4": 15360, "A10": 23028, "A100": 81920}


class _Unpruned(FleetIndex):
    """The index without the shortcuts: no reservation in the kind order, no skipping
    of partly booked nodes that cannot take the task."""

    def _may_share(self, n: NodeView, t: TaskDemand) -> bool:
        return True


node_st = st.tuples(
    st.sampled_from(sorted(MODELS)),
    st.integers(1, 4),  # cards
    st.sampled_from([0, 0, 0, 1500, 9000]),  # memory the node reports used per card
    st.sampled_from([True, True, True, True, False]),  # online
    st.sampled_from(["", "", "", "ta"]),  # dedicated to
)
demand_st = st.tuples(
    st.sampled_from([0, 1, 1, 1, 1, 2, 4]),  # cards
    st.sampled_from([20, 30, 45, 60, 90, 100]),  # commitment
    st.sampled_from([0, 4000, 9000, 13000, 14000, 19000, 21000, 60000, 75000]),
    st.sampled_from(["inference"] * 6 + ["training"]),
    st.sampled_from(["ta", "ta", "tb", "tc", ""]),  # share key (the tenant here)
    st.sampled_from(["", "", "", "", "T4", "A100"]),
    st.integers(0, 9),  # priority
    st.sampled_from(["tenant", "tenant", "tenant", "platform"]),
)


def build(spec: list[tuple[str, int, int, bool, str]]) -> list[NodeView]:
    return [
        NodeView(
            id=f"n{i:02d}", name=f"n{i:02d}", online=online,
            cards=[
                CardView(j, "nvidia", model, MODELS[model], used, nvlink_peers=frozenset(
                    k for k in range(n) if k != j))
                for j in range(n)
            ],
            cpu_count=16, memory_total_mb=65536,
            tenants=frozenset({tenant}) if tenant else frozenset(),
        )
        for i, (model, n, used, online, tenant) in enumerate(spec)
    ]


def demand(i: int, spec: tuple[int, int, int, str, str, str, int, str]) -> TaskDemand:
    gpus, pct, est, kind, key, gtype, prio, klass = spec
    return TaskDemand(
        task_id=f"t{i}", gpu_required=gpus, gpu_type=gtype if gpus else "",
        gpu_memory_utilization=pct, estimated_gpu_memory_mb=est if gpus else 0,
        memory_mb=0 if gpus else 2048, host_ports=(0,), task_type=kind, share_key=key,
        tenant_id=key, priority=prio, group_id=f"g{i}", priority_class=klass,
    )


def fill(nodes: list[NodeView], index: FleetIndex, demands: Iterable[TaskDemand],
         policy: Policy = POLICY) -> list[Placement | Unplaced]:
    out: list[Placement | Unplaced] = []
    for d in demands:
        r = place(d, index.order(d), RES, POOL, policy)
        out.append(r)
        if isinstance(r, Placement):
            node = index.by_id[r.node_id]
            book(node, r, d)
            index.update(node)
    return out


def index_for(nodes: list[NodeView], cls: type[FleetIndex] = FleetIndex) -> FleetIndex:
    kw = {"reservation": RES} if cls is FleetIndex else {}
    return cls(nodes, pack=POLICY.packs, load_threshold_pct=POLICY.load_threshold_pct,
               inference_cap=POLICY.inference_cap, **kw)


@pytest.mark.feature("B1")
@pytest.mark.feature("B3")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=st.lists(node_st, min_size=1, max_size=10),
       queue=st.lists(demand_st, min_size=1, max_size=40),
       sample=st.sampled_from([1, 1, 2, 4]))
def test_the_index_shortcuts_change_no_placement_and_no_reason(
    fleet: list[tuple[str, int, int, bool, str]],
    queue: list[tuple[int, int, int, str, str, str, int, str]],
    sample: int,
) -> None:
    # sample 1: the first node that passes wins, so any change of order would show
    policy = Policy(inference_cap=POLICY.inference_cap, sample=sample)
    demands = [demand(i, q) for i, q in enumerate(queue)]
    fast_nodes, plain_nodes = build(fleet), build(fleet)
    fast = fill(fast_nodes, index_for(fast_nodes), demands, policy)
    plain = fill(plain_nodes, index_for(plain_nodes, _Unpruned), demands, policy)
    assert fast == plain


def test_a_card_model_that_cannot_hold_the_estimate_after_the_reservation_is_walked_last(
) -> None:
    # 14,000 MB fits a T4's 15,360 raw, not its 15,360 - 500 - 1,536 = 13,324 available
    nodes = build([("T4", 4, 0, True, ""), ("T4", 4, 0, True, ""), ("A10", 2, 0, True, "")])
    d = demand(0, (1, 45, 14000, "inference", "ta", "", 0, "tenant"))
    order = [n.id if isinstance(n, NodeView) else n for n in index_for(nodes).order(d)]
    assert order == ["n02", "n00", "n01", None, Tally({})]
    # without the reservation in the index the T4s came first, to fail one by one
    plain = [n.id if isinstance(n, NodeView) else n for n in index_for(nodes, _Unpruned).order(d)]
    assert plain == ["n00", "n01", "n02", None, Tally({})]
    r = place(d, index_for(nodes).order(d), RES, POOL, POLICY)
    assert isinstance(r, Placement) and r.node_id == "n02"


def test_a_partly_booked_node_without_memory_left_waits_for_the_tail_and_counts_once(
) -> None:
    nodes = build([("A10", 1, 0, True, ""), ("A10", 1, 0, True, ""), ("A10", 1, 0, True, "")])
    tight, roomy, _ = nodes
    for node, est in ((tight, 17000), (roomy, 4000)):  # 30 % each: commitment left on both
        d = demand(9, (1, 30, est, "inference", "ta", "", 0, "tenant"))
        r = place(d, [node], RES, POOL, POLICY)
        assert isinstance(r, Placement)
        book(node, r, d)
    want = demand(1, (1, 30, 6000, "inference", "ta", "", 0, "tenant"))
    order = [n.id if isinstance(n, NodeView) else n for n in index_for(nodes).order(want)]
    # the tenant's card with room first, then the free card; the full one only in the tail
    assert order == ["n01", "n02", None, "n00", Tally({})]
    r = place(want, index_for(nodes).order(want), RES, POOL, POLICY)
    assert isinstance(r, Placement) and r.node_id == "n01"
    # nothing fits: every node is examined once and the reason counts all three
    big = demand(2, (1, 30, 19000, "inference", "ta", "", 0, "tenant"))
    for n in nodes[2:]:
        n.online = False
    u = place(big, index_for(nodes).order(big), RES, POOL, POLICY)
    assert isinstance(u, Unplaced) and u.seen == 3
    assert dict(u.counts) == {"offline": 1, "vram_short": 2}


# --- preemption ---------------------------------------------------------------------------


def reference_plan(
    t: TaskDemand, nodes: list[NodeView], res: Reservation, pool: range, policy: Policy
) -> Preemption | None:
    """plan_preemption as it was: every node, every victim prefix tried in turn."""
    best: tuple[tuple[int, int], Preemption] | None = None
    for node in nodes:
        if not node.online:
            continue
        if t.gpu_type and not any(c.model == t.gpu_type for c in node.cards):
            continue
        if t.gpu_required and not node.cards:
            continue
        lower = sorted(
            (o for o in node.occupants if may_preempt(t, o)),
            key=lambda o: (o.priority, -o.per_card_pct),
        )
        if not lower or not _could_fit(node, t, {o.task_id for o in lower}):
            continue
        trial = node.clone()
        victims: list[Occupant] = []
        for o in lower:
            unbook_occupant(trial, o)
            victims.append(o)
            if evaluate(trial, t, res, pool, policy)[0] is not None:
                victims = _trim(trial, node, victims, t, res, pool, policy)
                key = (len(victims), max(v.priority for v in victims))
                if best is None or key < best[0]:
                    best = (key, Preemption(node.id, tuple(victims)))
                break
    return best[1] if best else None


def put_to_sleep(node: NodeView, o: Occupant) -> None:
    """As the fleet read books a sleeping holder (services/placement/fleet._book_holders)."""
    o.sleeping = True
    for c in node.cards:
        if c.index in o.gpu_ids:
            c.sleeping += 1
            c.sleeping_mb += o.per_card_mb
            c.sleeping_pct += o.per_card_pct


@pytest.mark.feature("B4")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=st.lists(node_st, min_size=1, max_size=6),
       queue=st.lists(demand_st, min_size=1, max_size=30),
       asks=st.lists(demand_st, min_size=1, max_size=6),
       sleepers=st.sets(st.integers(0, 29), max_size=6))
def test_the_preemption_shortcuts_pick_the_same_victims(
    fleet: list[tuple[str, int, int, bool, str]],
    queue: list[tuple[int, int, int, str, str, str, int, str]],
    asks: list[tuple[int, int, int, str, str, str, int, str]],
    sleepers: set[int],
) -> None:
    nodes = build(fleet)
    index = index_for(nodes)
    fill(nodes, index, (demand(i, q) for i, q in enumerate(queue)))
    for n in nodes:
        for o in n.occupants:
            if int(o.task_id[1:]) in sleepers and o.inference:
                put_to_sleep(n, o)
    index = index_for(nodes)
    for i, a in enumerate(asks):
        want = demand(100 + i, (*a[:6], a[6] + 5, *a[7:]))  # above most of the queue
        before = copy.deepcopy(nodes)
        expected = reference_plan(want, nodes, RES, POOL, POLICY)
        got = plan_preemption(want, index.preemption_candidates(want), RES, POOL, POLICY)
        assert got == expected
        assert nodes == before  # the views are left as they were


@pytest.mark.feature("B4")
def test_a_victim_beside_sleeping_services_is_still_found() -> None:
    # Training may borrow a card whose holders all sleep (F5). On card 0, moving the
    # awake service (priority 1) is enough; moving every candidate victim would also
    # move the sleeper of priority 2 and leave the one of priority 9 alone there, a
    # card no longer "all asleep" by its counters, while card 1 is too used to take the
    # task even when free. So "would it fit with every victim gone?" must not rule this
    # node out when a candidate victim sleeps.
    n = build([("A100", 2, 0, True, "")])[0]
    n.cards[1].memory_used_mb = 60000
    for i, (prio, card) in enumerate(((1, 0), (2, 0), (9, 0), (3, 1))):
        d = demand(i, (1, 20, 8000, "inference", "ta", "", prio, "tenant"))
        book(n, Placement(n.id, (card,), 8000, 0, (20000 + i,), per_card_pct=20), d)
    put_to_sleep(n, n.occupants[1])
    put_to_sleep(n, n.occupants[2])
    want = demand(7, (1, 100, 30000, "training", "ta", "", 9, "tenant"))
    plan = plan_preemption(want, [n], RES, POOL, POLICY)
    assert plan == reference_plan(want, [n], RES, POOL, POLICY)
    assert plan is not None and [v.task_id for v in plan.victims] == ["t0"]


def test_preemption_candidates_are_the_online_nodes_of_the_type_in_fleet_order() -> None:
    nodes = build([("A100", 2, 0, True, ""), ("T4", 2, 0, True, ""),
                   ("A100", 2, 0, False, ""), ("A100", 1, 0, True, "")])
    nodes.append(NodeView(id="cpu", name="cpu", online=True, cards=[], cpu_count=8,
                          memory_total_mb=32768))
    index = index_for(nodes)
    ids = [n.id for n in index.preemption_candidates(
        demand(0, (1, 90, 0, "inference", "ta", "A100", 5, "tenant")))]
    assert ids == ["n00", "n03"]
    ids = [n.id for n in index.preemption_candidates(
        demand(0, (1, 90, 0, "inference", "ta", "", 5, "tenant")))]
    assert ids == ["n00", "n01", "n03"]
    ids = [n.id for n in index.preemption_candidates(
        demand(0, (0, 90, 0, "inference", "ta", "", 5, "tenant")))]
    assert ids == ["n00", "n01", "n03", "cpu"]


# --- the collector ------------------------------------------------------------------------


def test_a_round_pauses_the_collector_and_restores_it_as_it_was() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():  # a pool's rounds overlap: the inner one leaves it paused
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # someone else turned it off: a round does not turn it on
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("a failing round")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
