"""Scheduler v1 placement: reservation, commitment admission, memory fit, ports, commit."""

from __future__ import annotations

import pytest

from heteroflow.core.placement import (
    DEFAULT_CPU_TASK_MEMORY_MB,
    CardView,
    NodeView,
    Placement,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
    place,
)
from heteroflow.core.placement.filters import card_admits

RES = Reservation()
POOL = range(30000, 30010)


def card(
    index: int = 0,
    *,
    model: str = "A10",
    total: int = 10000,
    used: int = 0,
    committed_mb: int = 0,
    pct: int = 0,
) -> CardView:
    return CardView(
        index=index,
        vendor="nvidia",
        model=model,
        memory_total_mb=total,
        memory_used_mb=used,
        committed_mb=committed_mb,
        committed_pct=pct,
    )


def node(
    node_id: str,
    cards: list[CardView] | None = None,
    *,
    online: bool = True,
    cpu_count: int = 8,
    memory_total_mb: int = 64000,
    memory_committed_mb: int = 0,
    ports: set[int] | None = None,
) -> NodeView:
    return NodeView(
        id=node_id,
        name=node_id,
        online=online,
        cards=cards if cards is not None else [card()],
        cpu_count=cpu_count,
        memory_total_mb=memory_total_mb,
        memory_committed_mb=memory_committed_mb,
        ports_in_use=ports if ports is not None else set(),
    )


def demand(
    *,
    gpus: int = 1,
    gpu_type: str = "",
    pct: int = 50,
    est: int = 0,
    memory_mb: int = 0,
    host_ports: tuple[int, ...] = (0,),
    task_id: str = "t1",
) -> TaskDemand:
    return TaskDemand(
        task_id=task_id,
        gpu_required=gpus,
        gpu_type=gpu_type,
        gpu_memory_utilization=pct,
        estimated_gpu_memory_mb=est,
        memory_mb=memory_mb,
        host_ports=host_ports,
    )


def placed(result: Placement | Unplaced) -> Placement:
    assert isinstance(result, Placement), result
    return result


def unplaced(result: Placement | Unplaced) -> str:
    assert isinstance(result, Unplaced), result
    return result.reason


# --- reservation (B3) ---------------------------------------------------------------------


@pytest.mark.feature("B3")
@pytest.mark.parametrize(
    ("total", "expected"),
    [(10000, 1500), (24576, 500 + 2457), (81920, 500 + 8192), (0, 500)],
)
def test_reservation_is_500mb_plus_ten_percent(total: int, expected: int) -> None:
    assert RES.of(total) == expected


@pytest.mark.feature("B3")
def test_reservation_custom_values() -> None:
    assert Reservation(fixed_mb=0, ratio=0.25).of(8000) == 2000
    assert Reservation(fixed_mb=1000, ratio=0.0).of(8000) == 1000


@pytest.mark.feature("B3")
def test_available_uses_larger_of_reported_and_committed() -> None:
    assert card(total=10000).available_mb(RES) == 8500
    assert card(total=10000, used=2000).available_mb(RES) == 6500
    assert card(total=10000, used=2000, committed_mb=3000).available_mb(RES) == 5500
    assert card(total=10000, used=4000, committed_mb=3000).available_mb(RES) == 4500


# --- commitment admission (B2) ---------------------------------------------------------------


@pytest.mark.feature("B2")
def test_two_half_tasks_share_a_card_a_third_one_percent_does_not() -> None:
    c = card()
    assert card_admits(c, demand(pct=50), RES)[0] == ""
    c.committed_pct = 50
    assert card_admits(c, demand(pct=50), RES)[0] == ""
    c.committed_pct = 100
    assert card_admits(c, demand(pct=1), RES)[0] == "commitment_full"


@pytest.mark.feature("B2")
def test_two_half_tasks_share_one_card_through_place_and_commit() -> None:
    n = node("n1", [card()])
    nodes = [n]
    for tid in ("a", "b"):
        d = demand(pct=50, task_id=tid)
        p = placed(place(d, nodes, RES, POOL))
        assert p.gpu_ids == (0,)
        assert p.per_card_pct == 50
        book(n, p, d)
    assert n.cards[0].committed_pct == 100
    reason = unplaced(place(demand(pct=1), nodes, RES, POOL))
    assert "1% of memory commitment left" in reason


# --- memory estimate fit (B3) ----------------------------------------------------------------


@pytest.mark.feature("B3")
def test_known_estimate_must_fit_available_memory_boundary() -> None:
    # 10000 total, 2000 used, reservation 1500 -> 6500 available
    c = card(total=10000, used=2000)
    assert card_admits(c, demand(est=6500), RES)[0] == ""
    assert card_admits(c, demand(est=6501), RES)[0] == "vram_short"


@pytest.mark.feature("B3")
def test_reported_memory_used_is_counted_in_place() -> None:
    busy = node("busy", [card(total=10000, used=5000)])  # 3500 available
    assert "MB free after the reservation" in unplaced(place(demand(est=4000), [busy], RES, POOL))
    idle = node("idle", [card(total=10000, used=0)])
    assert placed(place(demand(est=4000), [busy, idle], RES, POOL)).node_id == "idle"


@pytest.mark.feature("B3")
def test_committed_estimates_count_when_larger_than_reported() -> None:
    c = card(total=10000, used=1000, committed_mb=6000)  # 10000-6000-1500 = 2500
    assert card_admits(c, demand(est=2500), RES)[0] == ""
    assert card_admits(c, demand(est=2501), RES)[0] == "vram_short"


@pytest.mark.feature("B3")
def test_unknown_estimate_skips_memory_check() -> None:
    c = card(total=10000, used=9999)
    assert card_admits(c, demand(est=0, pct=10), RES)[0] == ""


# --- filters (B1) ----------------------------------------------------------------------------


@pytest.mark.feature("B1")
def test_gpu_type_filter() -> None:
    nodes = [node("a10", [card(model="A10")]), node("a100", [card(model="A100")])]
    assert placed(place(demand(gpu_type="A100"), nodes, RES, POOL)).node_id == "a100"
    assert placed(place(demand(gpu_type="A10"), nodes, RES, POOL)).node_id == "a10"
    reason = unplaced(place(demand(gpu_type="H100"), nodes, RES, POOL))
    assert "no card of type 'H100'" in reason
    assert "2 node(s)" in reason


@pytest.mark.feature("B1")
def test_multi_card_task_needs_all_cards_on_one_node() -> None:
    split = [node("a", [card(0)]), node("b", [card(0)])]
    reason = unplaced(place(demand(gpus=2), split, RES, POOL))
    assert reason.startswith("InsufficientResources: 0/2 nodes fit")
    both = [*split, node("c", [card(0), card(1)])]
    p = placed(place(demand(gpus=2), both, RES, POOL))
    assert p.node_id == "c"
    assert sorted(p.gpu_ids) == [0, 1]


@pytest.mark.feature("B1")
def test_multi_card_counts_only_fitting_cards() -> None:
    n = node("n", [card(0, pct=80), card(1), card(2)])
    p = placed(place(demand(gpus=2, pct=50), [n], RES, POOL))
    assert sorted(p.gpu_ids) == [1, 2]
    assert isinstance(place(demand(gpus=3, pct=50), [n], RES, POOL), Unplaced)


@pytest.mark.feature("B1")
def test_within_node_fullest_fitting_card_is_chosen() -> None:
    n = node("n", [card(0, used=0), card(1, used=4000), card(2, used=9000)])
    # card 2 has 10000-9000-1500 < 0 available: cannot take 1000 MB
    p = placed(place(demand(est=1000), [n], RES, POOL))
    assert p.gpu_ids == (1,)
    assert p.per_card_mb == 1000


@pytest.mark.feature("B1")
@pytest.mark.parametrize("order", ["roomy_first", "tight_first"])
def test_binpack_across_nodes_prefers_least_available_that_fits(order: str) -> None:
    roomy = node("roomy", [card(total=40000)])
    tight = node("tight", [card(total=10000, used=3000)])  # 5500 available
    too_small = node("too-small", [card(total=10000, used=6000)])  # 2500 available
    nodes = [roomy, too_small, tight] if order == "roomy_first" else [tight, too_small, roomy]
    assert placed(place(demand(est=5000), nodes, RES, POOL)).node_id == "tight"


@pytest.mark.feature("B1")
def test_offline_nodes_skipped() -> None:
    off = node("off", [card(total=10000, used=3000)], online=False)  # would win binpack
    on = node("on", [card(total=40000)])
    assert placed(place(demand(est=1000), [off, on], RES, POOL)).node_id == "on"
    reason = unplaced(place(demand(), [off], RES, POOL))
    assert "1 node(s): offline" in reason


# --- CPU tasks (B1) --------------------------------------------------------------------------


@pytest.mark.feature("B1")
def test_cpu_task_most_free_memory_wins() -> None:
    a = node("a", [], memory_total_mb=10000)  # free 9000
    b = node("b", [], memory_total_mb=20000, memory_committed_mb=12000)  # free 6000
    p = placed(place(demand(gpus=0, memory_mb=2000), [b, a], RES, POOL))
    assert p.node_id == "a"
    assert p.gpu_ids == ()
    assert p.memory_mb == 2000
    assert p.per_card_pct == 0


@pytest.mark.feature("B1")
def test_cpu_task_memory_boundary_is_ninety_percent_minus_committed() -> None:
    n = node("n", [], memory_total_mb=10000, memory_committed_mb=1000)  # 9000 - 1000
    assert placed(place(demand(gpus=0, memory_mb=8000), [n], RES, POOL)).memory_mb == 8000
    reason = unplaced(place(demand(gpus=0, memory_mb=8001), [n], RES, POOL))
    assert "not 8001 MB of free memory for a CPU task" in reason


@pytest.mark.feature("B1")
def test_cpu_task_default_memory_and_ignores_busy_cards() -> None:
    full_card = card(pct=100, used=10000)
    n = node("n", [full_card], memory_total_mb=4000)
    p = placed(place(demand(gpus=0, memory_mb=0), [n], RES, POOL))
    assert p.memory_mb == DEFAULT_CPU_TASK_MEMORY_MB


@pytest.mark.feature("B1")
def test_cpu_task_needs_a_cpu() -> None:
    n = node("n", [], cpu_count=0)
    assert isinstance(place(demand(gpus=0, memory_mb=100), [n], RES, POOL), Unplaced)


# --- ports -----------------------------------------------------------------------------------


@pytest.mark.feature("B1")
@pytest.mark.feature("P2")
def test_host_port_zero_gets_lowest_free_pool_port() -> None:
    n = node("n", ports={30000, 30002})
    p = placed(place(demand(host_ports=(0, 0)), [n], RES, POOL))
    assert p.host_ports == (30001, 30003)


@pytest.mark.feature("B1")
@pytest.mark.feature("P2")
def test_explicit_port_is_kept_and_not_reused_from_pool() -> None:
    n = node("n")
    p = placed(place(demand(host_ports=(0, 30000)), [n], RES, POOL))
    assert p.host_ports == (30001, 30000)


@pytest.mark.feature("B1")
@pytest.mark.feature("P2")
def test_explicit_port_in_use_excludes_node() -> None:
    busy = node("busy", [card(total=10000, used=3000)], ports={8080})  # would win binpack
    free = node("free", [card(total=40000)])
    p = placed(place(demand(est=1000, host_ports=(8080,)), [busy, free], RES, POOL))
    assert p.node_id == "free"
    assert p.host_ports == (8080,)
    reason = unplaced(place(demand(host_ports=(8080,)), [busy], RES, POOL))
    assert "port" in reason


@pytest.mark.feature("B1")
def test_pool_exhausted_is_unplaced() -> None:
    n = node("n", ports=set(range(30000, 30002)))
    assert isinstance(place(demand(), [n], RES, range(30000, 30002)), Unplaced)
    reason = unplaced(place(demand(host_ports=(0, 0)), [node("m")], RES, range(30000, 30001)))
    assert "port pool exhausted" in reason


# --- commit ----------------------------------------------------------------------------------


@pytest.mark.feature("B2")
def test_commit_books_memory_pct_and_ports() -> None:
    n = node("n", [card(0), card(1)])
    d = demand(pct=60, est=3000)
    p = placed(place(d, [n], RES, POOL))
    book(n, p, d)
    booked = n.cards[p.gpu_ids[0]]
    other = n.cards[1 - p.gpu_ids[0]]
    assert (booked.committed_mb, booked.committed_pct) == (3000, 60)
    assert (other.committed_mb, other.committed_pct) == (0, 0)
    assert p.host_ports[0] in n.ports_in_use

    p2 = placed(place(demand(pct=60, est=3000, task_id="t2"), [n], RES, POOL))
    assert p2.gpu_ids != p.gpu_ids  # the booked card has only 40% left
    assert p2.host_ports != p.host_ports


@pytest.mark.feature("B3")
def test_commit_books_estimates_so_memory_is_not_double_booked() -> None:
    n = node("n", [card(total=10000)])  # 8500 available
    d1, d2 = demand(pct=10, est=4000), demand(pct=10, est=4000, task_id="t2")
    first = placed(place(d1, [n], RES, POOL))
    book(n, first, d1)
    second = placed(place(d2, [n], RES, POOL))
    book(n, second, d2)
    assert n.cards[0].committed_mb == 8000
    reason = unplaced(place(demand(pct=10, est=4000, task_id="t3"), [n], RES, POOL))
    assert "4000 MB free after the reservation" in reason


@pytest.mark.feature("B1")
def test_commit_books_cpu_memory() -> None:
    n = node("n", [], memory_total_mb=10000)  # 9000 free
    d = demand(gpus=0, memory_mb=5000)
    p = placed(place(d, [n], RES, POOL))
    book(n, p, d)
    assert n.memory_committed_mb == 5000
    assert isinstance(place(demand(gpus=0, memory_mb=5000), [n], RES, POOL), Unplaced)


# --- reasons ---------------------------------------------------------------------------------


@pytest.mark.feature("B1")
def test_unplaced_reasons_are_readable_and_distinct() -> None:
    reasons = {
        "none": unplaced(place(demand(), [], RES, POOL)),
        "offline": unplaced(place(demand(), [node("n", online=False)], RES, POOL)),
        "type": unplaced(place(demand(gpu_type="H100"), [node("n")], RES, POOL)),
        "vram": unplaced(place(demand(est=9000), [node("n")], RES, POOL)),
        "pct": unplaced(place(demand(pct=70), [node("n", [card(pct=40)])], RES, POOL)),
        "port": unplaced(place(demand(host_ports=(1,)), [node("n", ports={1})], RES, POOL)),
    }
    assert reasons["none"] == "InsufficientResources: no node has registered"
    assert "offline" in reasons["offline"]
    assert "no card of type 'H100'" in reasons["type"]
    assert "9000 MB free after the reservation" in reasons["vram"]
    assert "70% of memory commitment left" in reasons["pct"]
    assert "port" in reasons["port"]
    assert len(set(reasons.values())) == len(reasons)
    for key, r in reasons.items():
        assert r.startswith("InsufficientResources:"), key
        if key != "none":
            assert "0/1 nodes fit" in r


@pytest.mark.feature("B1")
def test_unplaced_reason_counts_each_cause() -> None:
    nodes = [
        node("off1", online=False),
        node("off2", online=False),
        node("small", [card(total=4000)]),
    ]
    reason = unplaced(place(demand(est=5000), nodes, RES, POOL))
    assert "0/3 nodes fit" in reason
    assert "2 node(s): offline" in reason
    assert "1 node(s): fewer than 1 card(s) with 5000 MB free" in reason


@pytest.mark.feature("B3")
def test_vram_reason_wins_over_commitment_when_both_occur() -> None:
    n = node("n", [card(0, pct=90), card(1, used=9000)])
    reason = unplaced(place(demand(pct=50, est=2000), [n], RES, POOL))
    assert "MB free after the reservation" in reason


@pytest.mark.feature("B1")
def test_gpu_task_on_cpu_only_node_has_a_readable_reason() -> None:
    reason = unplaced(place(demand(gpu_type=""), [node("cpu-only", [])], RES, POOL))
    assert reason.startswith("InsufficientResources: 0/1 nodes fit")
    assert "type ''" not in reason
