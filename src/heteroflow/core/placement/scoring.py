"""Scoring plugins (B1) and the card choice inside a node, all pure.

Each scorer maps (node, chosen cards, task) to 0..1; the pipeline adds them with the
cluster's weights (``Policy.scorers``). Preferences come first and are not weighed:
a node that holds the model wins, then one that reports the task's engine.

- binpack: prefer the node whose cards end up fullest, by commitment or by memory
  (keeps whole cards and whole nodes free for tensor-parallel work); spread: the
  opposite. CPU tasks always spread by memory (CPU inference contends for cores).
- topology: for multi-card tasks, the share of chosen card pairs linked by NVLink.
- rdma: a stage of a multi-node (pipeline) group prefers nodes labelled ``rdma``.
"""

from __future__ import annotations

from collections.abc import Callable

from heteroflow.core.placement.model import CardView, NodeView, TaskDemand

Scorer = Callable[[NodeView, list[CardView], TaskDemand], float]


def _fill_after(node: NodeView, chosen: list[CardView], t: TaskDemand) -> float:
    if not node.cards:  # CPU task: memory share after booking it
        if not node.memory_total_mb:
            return 0.0
        need = t.memory_mb
        return min(1.0, (node.memory_committed_mb + need) / node.memory_total_mb)
    picked = {c.index for c in chosen}
    total = 0.0
    for c in node.cards:
        mine = c.index in picked
        pct = c.committed_pct + (t.per_card_pct if mine else 0)
        mb = max(c.memory_used_mb, c.committed_mb) + (t.estimated_gpu_memory_mb if mine else 0)
        mem = mb / c.memory_total_mb if c.memory_total_mb else 0.0
        total += min(1.0, max(pct / 100, mem))
    return total / len(node.cards)


def binpack(node: NodeView, chosen: list[CardView], t: TaskDemand) -> float:
    return _fill_after(node, chosen, t)


def spread(node: NodeView, chosen: list[CardView], t: TaskDemand) -> float:
    return 1.0 - _fill_after(node, chosen, t)


def topology(node: NodeView, chosen: list[CardView], t: TaskDemand) -> float:
    if len(chosen) < 2:
        return 0.0
    pairs = linked = 0
    for i, a in enumerate(chosen):
        for b in chosen[i + 1 :]:
            pairs += 1
            linked += int(b.index in a.nvlink_peers)
    return linked / pairs


def rdma(node: NodeView, chosen: list[CardView], t: TaskDemand) -> float:
    return 1.0 if t.multi_node and node.rdma else 0.0


SCORERS: dict[str, Scorer] = {
    "binpack": binpack,
    "spread": spread,
    "topology": topology,
    "rdma": rdma,
}


def parse_scorers(spec: str) -> tuple[tuple[str, float], ...]:
    """"binpack:1,topology:2" -> (("binpack", 1.0), ("topology", 2.0)); ValueError names
    the bad part."""
    out: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r} (known: {', '.join(sorted(SCORERS))})")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"scorer {name!r}: weight {weight!r} is not a number") from None
        out.append((name, w))
    if {"binpack", "spread"} <= {n for n, _ in out}:
        raise ValueError("binpack and spread pull opposite ways; choose one")
    return tuple(out)


def pick_cards(
    fitting: list[CardView], t: TaskDemand, available: Callable[[CardView], int], pack: bool
) -> list[CardView]:
    """Which of a node's admitting cards a task gets.

    One shared card: the fullest that still fits (binpack) or the emptiest (spread).
    Several whole cards: an NVLink-connected set when the inventory shows one, else
    the lowest indices.
    """
    need = t.gpu_required
    if need == 1:
        best = min(fitting, key=lambda c: (available(c) if pack else -available(c), c.index))
        return [best]
    ordered = sorted(fitting, key=lambda c: c.index)
    if any(c.nvlink_peers for c in ordered):
        for seed in ordered:
            group = [seed]
            for c in ordered:
                if c is not seed and all(c.index in g.nvlink_peers for g in group):
                    group.append(c)
                    if len(group) == need:
                        return sorted(group, key=lambda c: c.index)
    return ordered[:need]


def qos(node: NodeView, cards: list[CardView]) -> str:
    """H5: derived, not chosen. MIG cards -> gold, MPS -> silver, else bronze;
    non-NVIDIA cards and containerised nodes -> bronze; CPU work -> bronze."""
    if not cards or node.containerized or any(c.vendor != "nvidia" for c in cards):
        return "bronze"
    if all(c.mig for c in cards):
        return "gold"
    if all(c.mps for c in cards):
        return "silver"
    return "bronze"
