"""bench/whole_card.py: the trace, and what its replay through the real placement code
says about sharing cards versus one whole card per instance (issue 18, item 5)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from heteroflow.settings import ServerSettings

from .bench_module import load_bench

GIB = 1024  # MiB


wc = load_bench("whole_card")
H100 = wc.Fleet("h100", (wc.node_kind("h100-sxm-8"),))


# the bench is loaded from its file (bench/ is not a package): its objects are Any here
def small(name: str, tenant: str, pct: int, estimate_mb: int = 8 * GIB) -> Any:
    return wc.Service(name, tenant, "small", "m", "hf", 1, 1, estimate_mb, commitment_pct=pct)


def both(trace: list[Any], fleet: Any = H100, policy: Any = None) -> tuple[Any, Any]:
    ours, whole = wc.HETEROFLOW, wc.WHOLE_CARD
    if policy is not None:
        ours = dataclasses.replace(ours, policy=policy)
        whole = dataclasses.replace(whole, policy=policy)
    return wc.replay(trace, fleet, ours), wc.replay(trace, fleet, whole)


def test_the_bench_places_with_the_shipped_defaults() -> None:
    s = ServerSettings.model_construct()  # defaults, whatever the environment says
    assert s.placement_policy() == wc.POLICY
    assert s.reservation() == wc.RESERVATION


def test_the_trace_is_seeded_and_has_the_stated_mix() -> None:
    trace = wc.make_trace()
    assert trace == wc.make_trace()
    assert [s.name for s in trace] != [s.name for s in wc.make_trace(wc.SEED + 1)]
    kinds = [s.kind for s in trace]
    assert len(trace) == 100
    assert (kinds.count("small"), kinds.count("mid"), kinds.count("tp")) == (55, 20, 15)
    assert kinds.count("training") + kinds.count("container") == 10
    assert {s.replicas for s in trace if s.kind == "small"} == {1, 2, 3, 4}
    pct = {k: [wc.size(s, H100).pct for s in trace if s.kind == k] for k in ("small", "mid")}
    assert min(pct["small"]) >= 5 and max(pct["small"]) <= 45
    assert min(pct["mid"]) >= 50 and max(pct["mid"]) <= 90
    assert all(s.cards in (2, 4, 8) for s in trace if s.kind == "tp")
    # night jobs come last, after every service they may borrow from
    night = [i for i, s in enumerate(trace) if s.night_only]
    assert night == list(range(len(trace) - len(night), len(trace))) and night


@pytest.mark.parametrize("fleet", wc.fleets(), ids=lambda f: f.name)
def test_whole_card_never_needs_fewer_cards_on_the_trace(fleet: Any) -> None:
    ours, whole = both(wc.make_trace(), fleet)
    assert whole.total_cards >= ours.total_cards
    assert whole.used_gib >= ours.used_gib
    assert ours.double_bookings == whole.double_bookings == 0
    assert ours.instances == whole.instances > 100


def test_on_80gb_cards_sharing_saves_cards_and_nodes() -> None:
    ours, whole = both(wc.make_trace())
    assert wc.ratio(whole, ours) > 1.2
    assert whole.total_nodes > ours.total_nodes
    assert ours.util_used > whole.util_used


def test_only_whole_card_work_gives_ratio_one() -> None:
    # TP replicas and training take whole cards under both policies; the night windows
    # are dropped, since borrowing a sleeping service's cards is a saving of its own
    trace = [dataclasses.replace(s, night_sleep=False) for s in wc.make_trace() if s.whole]
    assert trace and all(s.kind in ("tp", "training", "container") for s in trace)
    ours, whole = both(trace)
    assert wc.ratio(whole, ours) == 1.0
    assert whole.total_nodes == ours.total_nodes


def test_eight_services_at_12_percent_in_one_tenant_fit_one_card() -> None:
    trace = [small(f"s{i}", "acme", 12) for i in range(8)]
    ours, whole = both(trace)
    assert (ours.total_cards, ours.total_nodes) == (1, 1)
    assert (whole.total_cards, whole.total_nodes) == (8, 1)
    assert wc.ratio(whole, ours) == 8.0
    assert ours.util_used == pytest.approx(0.96)


def test_cards_are_shared_only_within_a_sharing_key() -> None:
    trace = [small(f"s{i}", f"tenant-{i}", 12) for i in range(8)]
    ours, whole = both(trace)
    assert ours.total_cards == whole.total_cards == 8
    # two tenants of one sharing group stack again
    grouped = [small(f"s{i}", "search" if i % 2 else "support", 12) for i in range(8)]
    assert both(grouped)[0].total_cards == 1


def test_the_estimate_bounds_stacking_as_well_as_the_commitment() -> None:
    # 8 x 12 % is within 100 %, but 8 x 11 GiB is over an H100 less its reservation
    trace = [small(f"s{i}", "acme", 12, estimate_mb=11 * GIB) for i in range(8)]
    assert both(trace)[0].total_cards == 2


def test_the_inference_cap_buys_a_node_that_commitment_alone_would_not() -> None:
    trace = [small(f"s{i}", "acme", 10, estimate_mb=6 * GIB) for i in range(9)]
    ours, _ = both(trace)
    assert (ours.total_cards, ours.total_nodes) == (2, 2)  # 8 containers per node
    raised = dataclasses.replace(wc.POLICY, inference_cap=32)
    ours, whole = both(trace, policy=raised)
    assert (ours.total_cards, ours.total_nodes) == (1, 1)
    assert whole.total_cards == 9


def test_night_training_borrows_a_sleeping_service_of_its_own_key() -> None:
    served = wc.Service("big", "research", "tp", "m", "hf", 1, 8, 8 * 40 * GIB,
                        night_sleep=True)
    job = wc.Service("sft", "research", "training", "", "", 1, 8, 0, night_only=True)
    ours, whole = both([served, job])
    assert (ours.total_cards, ours.borrowed) == (8, 1)
    assert (whole.total_cards, whole.borrowed) == (16, 0)
    assert ours.double_bookings == 0
    other = dataclasses.replace(job, tenant="labs")  # another key: its own cards
    assert both([served, other])[0].total_cards == 16


def test_a_service_too_big_for_the_card_is_tp_doubled_or_left_out() -> None:
    a100_40 = next(f for f in wc.fleets() if f.name.startswith("8xA100"))
    mid = wc.Service("mid", "acme", "mid", "m", "hf", 1, 1, 60 * GIB)
    z = wc.size(mid, a100_40)
    assert (z.cards, z.whole) == (2, True)
    huge = wc.Service("huge", "acme", "tp", "m", "hf", 1, 8, 8 * 60 * GIB)
    assert wc.size(huge, a100_40) is None
    out = wc.replay([mid, huge], a100_40, wc.HETEROFLOW)
    assert (out.resized, out.left_out, out.total_cards) == (["mid"], ["huge"], 2)


def test_the_mixed_fleet_puts_each_service_on_the_smallest_card_that_holds_it() -> None:
    mixed = next(f for f in wc.fleets() if f.mixed)
    tiny = wc.size(small("t", "acme", 0, estimate_mb=4 * GIB), mixed)
    assert tiny.kind.name == "a10-2" and tiny.pct == 20  # 4 GiB of a 22.5 GiB A10
    mid = wc.size(wc.Service("m", "acme", "mid", "m", "hf", 1, 1, 50 * GIB), mixed)
    assert mid.kind.name == "h100-sxm-8" and mid.cards == 1
