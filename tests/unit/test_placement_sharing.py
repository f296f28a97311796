"""B4-B7, G1, H5: card sharing rules, scorers, gangs, preemption, QoS, the fleet index."""

from __future__ import annotations

import dataclasses
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
    parse_scorers,
    place,
    place_gang,
    plan_preemption,
)
from heteroflow.core.placement.fleet import Tally

RES = Reservation()
POOL = range(20000, 20100)


def cards(n: int, model: str = "H100", total: int = 81920, **kw: object) -> list[CardView]:
    return [CardView(i, "nvidia", model, total, **kw) for i in range(n)]  # type: ignore[arg-type]


def node(name: str, n_cards: int = 1, **kw: Any) -> NodeView:
    c = kw.pop("cards", None) or cards(n_cards)
    return NodeView(
        id=name, name=name, online=True, cards=c, cpu_count=32, memory_total_mb=262144, **kw
    )


def demand(tid: str = "t", **kw: object) -> TaskDemand:
    base: dict[str, object] = dict(
        task_id=tid, gpu_required=1, gpu_type="", gpu_memory_utilization=40,
        estimated_gpu_memory_mb=0, memory_mb=0, host_ports=(0,), share_key="tenant-a",
    )
    base.update(kw)
    return TaskDemand(**base)  # type: ignore[arg-type]


def placed(r: Placement | Unplaced) -> Placement:
    assert isinstance(r, Placement), r
    return r


def unplaced(r: Placement | Unplaced | list[Placement]) -> str:
    assert isinstance(r, Unplaced), r
    return r.reason


def put(n: NodeView, d: TaskDemand) -> Placement:
    p = placed(place(d, [n], RES, POOL))
    book(n, p, d)
    return p


# --- B6: sharing rules --------------------------------------------------------------------


@pytest.mark.feature("B6")
def test_one_tenants_inference_services_stack_on_a_card_by_commitment() -> None:
    n = node("n")
    for i in range(2):
        assert put(n, demand(f"t{i}", gpu_memory_utilization=50)).gpu_ids == (0,)
    reason = unplaced(place(demand("t3", gpu_memory_utilization=1), [n], RES, POOL))
    assert "1% of memory commitment left" in reason


@pytest.mark.feature("B5")
@pytest.mark.feature("B6")
def test_cross_tenant_red_line_and_sharing_groups() -> None:
    n = node("n")
    put(n, demand("a1"))
    reason = unplaced(place(demand("b1", share_key="tenant-b"), [n], RES, POOL))
    assert "another tenant's work" in reason
    # two tenants in one sharing group carry the group's key: they may share
    g = node("g")
    put(g, demand("a1", share_key="sg-1"))
    assert put(g, demand("b1", share_key="sg-1")).gpu_ids == (0,)


@pytest.mark.feature("B6")
def test_tensor_parallel_takes_whole_free_cards_outside_the_percentage_protocol() -> None:
    n = node("n", 4)
    put(n, demand("small", gpu_memory_utilization=10))  # card 0 partly used
    p = put(n, demand("tp", gpu_required=3))
    assert 0 not in p.gpu_ids and len(p.gpu_ids) == 3 and p.per_card_pct == 100
    reason = unplaced(place(demand("tp2", gpu_required=2), [n], RES, POOL))
    assert "wholly free" in reason
    # and nothing stacks onto a card a TP replica holds
    assert put(n, demand("s2", gpu_memory_utilization=10)).gpu_ids == (0,)


@pytest.mark.feature("B6")
def test_inference_never_shares_with_non_inference() -> None:
    n = node("n")
    put(n, demand("inf"))
    reason = unplaced(place(demand("job", task_type="training"), [n], RES, POOL))
    assert "work of another kind" in reason
    m = node("m")
    put(m, demand("job", task_type="container"))
    assert "another kind" in unplaced(place(demand("inf"), [m], RES, POOL))


@pytest.mark.feature("B6")
def test_training_borrows_the_cards_of_a_sleeping_inference_service_only() -> None:
    n = node("n")
    put(n, demand("inf", gpu_memory_utilization=90, estimated_gpu_memory_mb=60000))
    assert isinstance(place(demand("job", task_type="training"), [n], RES, POOL), Unplaced)
    c = n.cards[0]
    c.sleeping, c.sleeping_mb, c.sleeping_pct = 1, 60000, 90  # the service went to sleep
    p = placed(place(demand("job", task_type="training", estimated_gpu_memory_mb=60000),
                     [n], RES, POOL))
    assert p.borrowed and p.gpu_ids == (0,)
    # plain containers do not borrow, and other tenants never do
    assert isinstance(place(demand("c", task_type="container"), [n], RES, POOL), Unplaced)
    other = demand("j2", task_type="training", share_key="tenant-b")
    assert "another tenant" in unplaced(place(other, [n], RES, POOL))


# --- scorers ------------------------------------------------------------------------------


@pytest.mark.feature("B1")
def test_binpack_stacks_and_spread_fans_out() -> None:
    a, b = node("a"), node("b")
    put(a, demand("first", gpu_memory_utilization=30))
    assert placed(place(demand(), [b, a], RES, POOL)).node_id == "a"
    spread = Policy(scorers=parse_scorers("spread:1"))
    assert placed(place(demand(), [a, b], RES, POOL, spread)).node_id == "b"


@pytest.mark.feature("B1")
def test_topology_prefers_an_nvlink_connected_set() -> None:
    linked = cards(4)
    for c in linked:
        c.nvlink_peers = frozenset(i for i in range(4) if i != c.index)
    pcie, nvl = node("pcie", cards=cards(4)), node("nvlink", cards=linked)
    p = placed(place(demand(gpu_required=4), [pcie, nvl], RES, POOL))
    assert p.node_id == "nvlink"
    # inside a node: a pair of cards that are peers wins over the lowest indices
    part = cards(4)
    part[1].nvlink_peers, part[3].nvlink_peers = frozenset({3}), frozenset({1})
    p = placed(place(demand(gpu_required=2), [node("n", cards=part)], RES, POOL))
    assert p.gpu_ids == (1, 3)


@pytest.mark.feature("B1")
def test_rdma_label_attracts_pipeline_stages_only() -> None:
    plain, rdma = node("plain"), node("rdma", labels={"rdma": "true"})
    stage = demand(task_type="training", multi_node=True)
    assert placed(place(stage, [plain, rdma], RES, POOL)).node_id == "rdma"
    assert placed(place(demand(task_type="training"), [plain, rdma], RES, POOL)).node_id == "plain"


def test_scorer_spec_errors_name_the_part() -> None:
    assert parse_scorers("binpack:2, rdma") == (("binpack", 2.0), ("rdma", 1.0))
    with pytest.raises(ValueError, match="unknown scorer 'bestfit'"):
        parse_scorers("bestfit:1")
    with pytest.raises(ValueError, match="not a number"):
        parse_scorers("binpack:x")
    with pytest.raises(ValueError, match="opposite"):
        parse_scorers("binpack,spread")


# --- H5 QoS -------------------------------------------------------------------------------


@pytest.mark.feature("H5")
def test_qos_is_derived_from_the_cards_and_the_node() -> None:
    assert placed(place(demand(), [node("n", cards=cards(1, mig=True))], RES, POOL)).qos == "gold"
    assert placed(place(demand(), [node("n", cards=cards(1, mps=True))], RES, POOL)).qos == "silver"
    assert placed(place(demand(), [node("n")], RES, POOL)).qos == "bronze"
    amd = [CardView(0, "amd", "MI300X", 196608, mig=True)]
    assert placed(place(demand(), [node("n", cards=amd)], RES, POOL)).qos == "bronze"
    boxed = node("n", cards=cards(1, mig=True), labels={"heteroflow.containerized": "true"})
    assert placed(place(demand(), [boxed], RES, POOL)).qos == "bronze"
    cpu = placed(place(demand(gpu_required=0), [node("c", cards=[])], RES, POOL))
    assert cpu.qos == "bronze"


# --- G1 gangs -----------------------------------------------------------------------------


@pytest.mark.feature("G1")
def test_a_gang_is_placed_whole_or_not_at_all_and_leaves_views_untouched() -> None:
    nodes = [node("a", 2), node("b", 2)]
    stages = [demand(f"s{i}", task_type="training", gpu_required=2, multi_node=True)
              for i in range(2)]
    r = place_gang(stages, nodes, RES, POOL)
    assert isinstance(r, list) and {p.node_id for p in r} == {"a", "b"}
    assert all(c.free for n in nodes for c in n.cards)  # the caller books what it commits
    three = [*stages, demand("s2", task_type="training", gpu_required=2, multi_node=True)]
    reason = unplaced(place_gang(three, nodes, RES, POOL))
    assert reason.startswith("gang of 3: member s2 does not fit")
    assert all(c.free for n in nodes for c in n.cards) and not any(n.occupants for n in nodes)


# --- B4 preemption ------------------------------------------------------------------------


@pytest.mark.feature("B4")
def test_preemption_picks_the_fewest_lowest_priority_victims() -> None:
    a, b = node("a", 2), node("b", 2)
    put(a, demand("a-low", task_type="training", gpu_required=2, priority=10))
    put(b, demand("b-mid", task_type="training", priority=50))
    put(b, demand("b-low", task_type="training", priority=5))
    want = demand("urgent", task_type="training", gpu_required=1, priority=100)
    assert isinstance(place(want, [a, b], RES, POOL), Unplaced)
    plan = plan_preemption(want, [a, b], RES, POOL, Policy())
    assert plan is not None
    assert (plan.node_id, [v.task_id for v in plan.victims]) == ("b", ["b-low"])


@pytest.mark.feature("B4")
def test_equal_or_higher_priority_and_already_preempted_tasks_are_never_victims() -> None:
    a = node("a")
    put(a, demand("same", task_type="training", priority=100))
    want = demand("urgent", task_type="training", priority=100)
    assert plan_preemption(want, [a], RES, POOL, Policy()) is None
    b = node("b")
    put(b, demand("low", task_type="training", priority=1))
    b.occupants[0].preempting = True
    assert plan_preemption(want, [b], RES, POOL, Policy()) is None


@pytest.mark.feature("B4")
def test_preemption_drops_victims_the_task_does_not_need_gone() -> None:
    n = node("n", 2)
    put(n, demand("lowest", task_type="training", priority=1))  # card 0
    put(n, demand("low", gpu_memory_utilization=90, priority=2, share_key="tenant-a"))
    want = demand("urgent", task_type="training", priority=9)
    plan = plan_preemption(want, [n], RES, POOL, Policy())
    assert plan is not None and [v.task_id for v in plan.victims] == ["lowest"]


# --- the fleet index ----------------------------------------------------------------------


@pytest.mark.feature("B1")
def test_fleet_index_tries_model_holders_then_the_tightest_fit() -> None:
    holder = node("holder", 8, models=frozenset({"/m/a.gguf"}), allowed_volume_prefixes=("/m",))
    full = node("three-free", 4)
    for d in (demand(f"x{i}", task_type="training") for i in range(1)):
        book(full, placed(place(d, [full], RES, POOL)), d)
    empty = node("empty", 8)
    other = node("a10", cards=cards(2, model="A10"))
    idx = FleetIndex([empty, other, full, holder])
    order = [n.id if isinstance(n, NodeView) else n for n in idx.order(demand(
        gpu_required=2, model_path="/m/a.gguf", gpu_type="H100"))]
    # after the mark (None): nodes that can only explain a failure, here counted in bulk
    assert order == ["holder", "three-free", "empty", None, Tally({"gpu_type_mismatch": 1})]
    assert placed(place(demand(model_path="/m/a.gguf"), idx.order(demand(
        model_path="/m/a.gguf")), RES, POOL)).node_id == "holder"


# --- B2/B5: every reason key reads as a sentence ------------------------------------------


def _offline(n: NodeView, d: TaskDemand) -> TaskDemand:
    n.online = False
    return d


def _busy(n: NodeView, d: TaskDemand) -> TaskDemand:
    n.cpu_percent = 95.0
    return d


def _capped(n: NodeView, d: TaskDemand) -> TaskDemand:
    n.inference_tasks = 8
    return d


def _dedicated(n: NodeView, d: TaskDemand) -> TaskDemand:
    n.tenants = frozenset({"tn-other"})
    return dataclasses.replace(d, tenant_id="tn-mine")


@pytest.mark.feature("B2")
@pytest.mark.feature("B5")
@pytest.mark.parametrize(
    ("setup", "want"),
    [
        (_offline, "offline"),
        (_dedicated, "dedicated to other tenants"),
        (lambda n, d: dataclasses.replace(d, gpu_type="A10"), "no card of type 'A10'"),
        (_busy, "CPU or memory use above 90%"),
        (_capped, "already 8 inference containers"),
        (lambda n, d: dataclasses.replace(d, estimated_gpu_memory_mb=90000),
         "with 90000 MB free after the reservation"),
        (lambda n, d: dataclasses.replace(d, engine="mindie",
                                          engine_vendors=frozenset({"ascend"})),
         "vendor the engine mindie does not run on"),
        (lambda n, d: dataclasses.replace(d, host_ports=(8080,)), "host port in use"),
        (lambda n, d: dataclasses.replace(d, model_path="/secret/m.gguf"),
         "model_path '/secret/m.gguf' outside the node's allowed volume prefixes"),
        (lambda n, d: dataclasses.replace(d, gpu_required=0, memory_mb=10**9),
         "MB of free memory for a CPU task"),
    ],
)
def test_each_reason_is_named(setup: Any, want: str) -> None:
    n = node("n")
    n.ports_in_use.add(8080)
    d = setup(n, demand())
    reason = unplaced(place(d, [n], RES, POOL))
    assert reason.startswith("InsufficientResources: 0/1 nodes fit — 1 node(s): ")
    assert want in reason
