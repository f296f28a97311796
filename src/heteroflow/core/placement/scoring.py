"""Scoring plugins (B1) and the card choice inside a node, all pure.

Each scorer maps (node, chosen cards, task) to 0..1; the pipeline adds them with the
cluster's weights (``Policy.scorers``). Preferences come first and are not weighed:
a node that holds the model wins, then one that reports the task's engine.

- binpack: prefer the node whose cards end up fullest, by commitment or by memory
  (keeps whole cards and whole nodes free for tensor-parallel work); spread: the
  opposite. CPU tasks always spread by memory (CPU inference contends for cores).
- topology: for multi-card tasks, the share of chosen card pairs linked by NVLink.
- rdma: a stage of a multi-node (pipeline) group prefers nodes labelled ``rdma``.

Model locality (``locality``, issue 29 item 3) is the first preference: a node holds
the task's model when it reports its path (the C10 scan) or, for a source
(``hf://…``, ``modelscope://…``, ``https://…``), a complete copy in its cache; among
the nodes that do not, one with a download of it in progress (more bytes fetched) comes
first. The start-time difference is the download: ``download_s`` is the model's size
(less what the node already fetched) over a nominal rate (``Policy.download_mb_s``, the
``model_download_mb_s`` setting) — an estimate shown by the dry run, not weighed against
the scorers: a download of minutes outweighs any packing preference.
"""

from __future__ import annotations

from collections.abc import Callable

from heteroflow.core.placement.model import CachedCopy, CardView, NodeView, TaskDemand

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


def copy_matches(c: CachedCopy, source: str, revision: str = "") -> bool:
    """Whether a cached copy is the model of ``source`` (canonical text): fetched for it,
    pinned at the revision it names (``@<commit>``), or named by its cache key
    (``fleet://<key>``); with ``revision`` (what a create resolved) only a copy at that
    revision. A round knows no revision (a task row keeps the text as given), so any
    revision of the named source counts there."""
    return bool(source) and source in (c.source, c.pinned, c.fleet) and (
        not revision or c.revision == revision
    )


def locality(node: NodeView, t: TaskDemand) -> tuple[int, int]:
    """(1 when the node holds the task's model, else 0; bytes of it a download in
    progress there has fetched so far): the first part of the ranking key."""
    if t.model_path and t.model_path in node.models:
        return 1, 0
    src = t.model_source
    if not src or not node.cached_models:
        return 0, 0
    fetched = 0
    for c in node.cached_models:
        if copy_matches(c, src):
            if c.complete:
                return 1, 0
            fetched = max(fetched, c.bytes)
    return 0, fetched


def download_s(node: NodeView, t: TaskDemand, rate_mb_s: float) -> float | None:
    """Seconds of download before ``t`` could start on ``node`` at the nominal rate: 0
    where it holds the model; None when the size is unknown (``t.model_bytes`` 0) or
    the rate is not positive."""
    held, fetched = locality(node, t)
    if held:
        return 0.0
    if t.model_bytes <= 0 or rate_mb_s <= 0:
        return None
    return download_estimate_s(max(t.model_bytes - fetched, 0), rate_mb_s) or 0.0


def download_estimate_s(size_bytes: int, rate_mb_s: float) -> float | None:
    """``size_bytes`` over the nominal rate (MB/s, 10^6 bytes), in seconds rounded to
    0.1; None when the size is unknown (0) or the rate is not positive."""
    if size_bytes <= 0 or rate_mb_s <= 0:
        return None
    return round(size_bytes / (rate_mb_s * 1e6), 1)


def cached_on(nodes: list[NodeView], source: str, revision: str = "") -> list[str]:
    """The names of the nodes whose cache holds a complete copy of ``source`` (at
    ``revision`` when given), in the order given."""
    return [
        n.name for n in nodes
        if any(c.complete and copy_matches(c, source, revision) for c in n.cached_models)
    ]


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
