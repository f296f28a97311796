"""The placement pipeline (B1) for one task, and all-or-nothing gangs (G1).

Order: online → GPU type → sharing rules and VRAM (with the B3 reservation) → load
threshold → inference container cap → commitment admission; among the nodes that pass,
model locality (a path the node reports or a source in its cache, then a download in
progress), then engine availability, then the weighted scoring plugins. The
caller gives the nodes in the order it wants them tried (``fleet.FleetIndex`` puts the
likely winners first, then a ``None`` mark after which no node can win); the scan stops
once ``Policy.sample`` nodes passed, or at the mark with a candidate in hand, so a
decision costs O(sample) on a large fleet instead of O(nodes). When none passes, every
node was examined and the reason counts them all (B2, B5).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from heteroflow.core.engines.registry import runs_on_cpu
from heteroflow.core.placement import filters as f
from heteroflow.core.placement.fleet import Tally
from heteroflow.core.placement.model import (
    CardView,
    NodeView,
    Placement,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
)
from heteroflow.core.placement.reasons import explain
from heteroflow.core.placement.scoring import SCORERS, locality, pick_cards, qos, spread


@dataclass(frozen=True, slots=True)
class Policy:
    """Per-cluster knobs of the pipeline (B1); settings.placement_policy() builds it."""

    load_threshold_pct: float = 90.0  # a node busier than this (CPU or memory) is skipped
    inference_cap: int = 8  # inference containers per node, sleeping ones included
    scorers: tuple[tuple[str, float], ...] = (("binpack", 1.0), ("topology", 1.0), ("rdma", 1.0))
    sample: int = 4  # stop scanning once this many nodes passed every filter
    preemption: bool = True
    # issue 29: the nominal rate a node downloads a model at (MB/s): a start estimate
    # (``scoring.download_s``), not a weight
    download_mb_s: float = 100.0

    @property
    def packs(self) -> bool:
        return not any(name == "spread" for name, _ in self.scorers)


def evaluate(
    node: NodeView, t: TaskDemand, res: Reservation, pool: range, policy: Policy
) -> tuple[Placement | None, list[CardView], str]:
    """One node through the filters: (placement, its cards, "") or (None, [], reason)."""
    why = f.node_gate(node, t, policy.load_threshold_pct, policy.inference_cap)
    if why in (f.OFFLINE, f.RESERVED, f.PROCESS_RUNTIME, f.VOLUME):
        return None, [], why
    if t.gpu_required == 0:
        need, free = f.cpu_room(node, t)
        if not runs_on_cpu(t.engine, node.cpu_build(t.engine)):
            return None, [], f.ENGINE_VENDOR  # a GPU engine, and not its CPU build here
        if why:
            return None, [], why
        if node.cpu_count < 1 or free < need:
            return None, [], f.MEMORY_SHORT
        ports = f.ports_for(t, node, pool)
        if ports is None:
            return None, [], f.PORTS
        return Placement(node.id, (), 0, need, ports, qos="bronze"), [], ""
    cards, type_why = f.typed_cards(node, t)
    if type_why:
        return None, [], type_why
    fitting: list[CardView] = []
    borrowed = False
    reasons: dict[str, int] = {}
    for c in cards:
        card_why, borrow = f.card_admits(c, t, res)
        if card_why:
            reasons[card_why] = reasons.get(card_why, 0) + 1
        else:
            fitting.append(c)
            borrowed = borrowed or borrow
    if len(fitting) < t.gpu_required:
        # the sharing rules and memory come before load and the inference filters (B1)
        order = (f.CROSS_TENANT, f.KIND_MIX, f.WHOLE_BUSY, f.VRAM_SHORT, f.COMMITMENT_FULL)
        hard = [k for k in order if k in reasons and k != f.COMMITMENT_FULL]
        if hard:
            return None, [], max(hard, key=lambda k: reasons[k])
        return None, [], why or f.COMMITMENT_FULL
    if why:
        return None, [], why
    ports = f.ports_for(t, node, pool)
    if ports is None:
        return None, [], f.PORTS
    chosen = pick_cards(fitting, t, lambda c: c.available_mb(res), policy.packs)
    p = Placement(
        node.id,
        tuple(c.index for c in chosen),
        t.estimated_gpu_memory_mb,
        0,
        ports,
        per_card_pct=t.per_card_pct,
        qos=qos(node, chosen),
        borrowed=borrowed,
    )
    return p, chosen, ""


def place(
    t: TaskDemand,
    nodes: Iterable[NodeView | Tally | None],
    res: Reservation,
    pool: range,
    policy: Policy = Policy(),  # frozen: a shared default is safe
) -> Placement | Unplaced:
    """Choose a node (and cards) for one task, or say precisely why none fits."""
    counts: dict[str, int] = {}
    best: tuple[tuple[int, int, int, float, int], Placement] | None = None
    passed = seen = 0
    for node in nodes:
        if node is None:  # the index's mark: what follows cannot win
            if best is not None:
                break
            continue
        if isinstance(node, Tally):  # nodes the index ruled out in bulk, for the reason
            for k, n in node.counts.items():
                counts[k] = counts.get(k, 0) + n
                seen += n
            continue
        seen += 1
        p, chosen, why = evaluate(node, t, res, pool, policy)
        if p is None:
            counts[why] = counts.get(why, 0) + 1
            continue
        if t.gpu_required == 0:
            score = spread(node, chosen, t)
        else:
            score = sum(w * SCORERS[name](node, chosen, t) for name, w in policy.scorers)
        held, fetched = locality(node, t)  # issue 29: a cached source counts as held
        engine = int(bool(t.engine) and t.engine in node.engines)
        key = (held, fetched, engine, score, -passed)  # ties: the first found (index order)
        if best is None or key > best[0]:
            best = (key, p)
        passed += 1
        if passed >= policy.sample:
            break
    if best is not None:
        return best[1]
    why = explain(t, seen, counts, policy.load_threshold_pct, policy.inference_cap)
    return Unplaced(why, seen, tuple(sorted(counts.items())))


def place_gang(
    tasks: list[TaskDemand],
    nodes: list[NodeView],
    res: Reservation,
    pool: range,
    policy: Policy = Policy(),
) -> list[Placement] | Unplaced:
    """G1: every task of the gang is placed, or none is (the views are left unchanged).

    Members are placed in order, each booked before the next is tried, so two stages
    never take the same card; any member that does not fit rolls the others back.
    """
    by_id = {n.id: n for n in nodes}
    done: list[tuple[Placement, TaskDemand]] = []
    for t in tasks:
        r = place(t, nodes, res, pool, policy)
        if isinstance(r, Unplaced):
            for p, dt in reversed(done):
                book(by_id[p.node_id], p, dt, -1)
            return Unplaced(f"gang of {len(tasks)}: member {t.task_id} does not fit — {r.reason}")
        book(by_id[r.node_id], r, t)
        done.append((r, t))
    for p, dt in reversed(done):  # the caller books what it commits
        book(by_id[p.node_id], p, dt, -1)
    return [p for p, _ in done]
