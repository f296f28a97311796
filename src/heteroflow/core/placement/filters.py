"""Filters of the placement pipeline (B1): each says whether a node or card passes, and
if not, a reason key that ``reasons.explain`` turns into a readable sentence (B2, B5).

Card rules (B6):
- inference tasks on one card stack by memory commitment: the commitments of the tasks
  on it, this one included, sum to at most 100% and the task's memory estimate fits in
  total - max(used, committed) - reservation (B3);
- tensor-parallel replicas and all non-inference work take whole free cards, outside the
  percentage protocol; inference never shares a card with non-inference work, except
  training borrowing the cards of a sleeping inference service (F5);
- cross-tenant red line: a card holds the work of one tenant or one sharing group.
"""

from __future__ import annotations

from heteroflow.core.containers import process_runs
from heteroflow.core.paths import on_host, volume_allows
from heteroflow.core.placement.model import (
    CPU_TASK_MEMORY_SHARE,
    DEFAULT_CPU_TASK_MEMORY_MB,
    CardView,
    NodeView,
    Reservation,
    TaskDemand,
)

# reason keys, in the order the pipeline checks them
OFFLINE = "offline"
RESERVED = "reserved"
PROCESS_RUNTIME = "process_runtime"
VOLUME = "volume"
NO_GPUS = "no_gpus"
TYPE_MISMATCH = "gpu_type_mismatch"
PORTS = "ports"
CROSS_TENANT = "cross_tenant"
KIND_MIX = "kind_mix"
WHOLE_BUSY = "whole_busy"
ENGINE_VENDOR = "engine_vendor"
VRAM_SHORT = "vram_short"
OVERLOADED = "overloaded"
CONTAINER_CAP = "container_cap"
COMMITMENT_FULL = "commitment_full"
MEMORY_SHORT = "memory_short"
HOST_VOLUME = "host_volume"  # A2: a volume's host path outside the node's rule
NO_MOUNTS = "no_mounts"  # A2: the process runtime mounts nothing


def card_admits(card: CardView, t: TaskDemand, res: Reservation) -> tuple[str, bool]:
    """("", borrowed) when the card admits the task, else (reason key, False)."""
    if card.holders and card.share_key and t.share_key and card.share_key != t.share_key:
        return CROSS_TENANT, False
    others = card.holders - card.inference  # non-inference work on the card
    borrow = False
    if t.whole and not card.free:
        borrow = t.task_type == "training" and 0 < card.holders == card.inference == card.sleeping
        if not borrow:
            mixed = (card.inference > 0) if not t.inference else (others > 0)
            return (KIND_MIX if mixed else WHOLE_BUSY), False
    elif not t.whole:
        if others > 0:
            return KIND_MIX, False
        if card.whole_holders:
            return WHOLE_BUSY, False
    need = t.estimated_gpu_memory_mb
    if need and need > card.available_mb(res, borrow=borrow):
        return VRAM_SHORT, False
    if not t.whole and card.committed_pct + t.gpu_memory_utilization > 100:
        return COMMITMENT_FULL, False
    return "", borrow


def node_gate(node: NodeView, t: TaskDemand, thr: float, cap: int) -> str:
    """The node-level checks that need no card: online, dedication, runtime, the node's
    volume rule for an absolute model path (C4: its agent would refuse it; issue 26),
    load threshold, container cap.

    The load threshold (other programs' CPU or memory use) gates GPU work only: a CPU
    engine is admitted by the memory really free on the node (``cpu_room``), and CPU
    contention slows it rather than breaks it — on a one-machine install the user's
    only node is never stranded behind their browser (issue 12)."""
    if not node.online:
        return OFFLINE
    if node.tenants and t.tenant_id and t.tenant_id not in node.tenants:
        return RESERVED  # dedicated to other tenants (same rule as NodeView.visible_to)
    if node.runtime == "process" and (
        t.needs_container or not process_runs(t.engine, node.engines)
    ):
        return PROCESS_RUNTIME  # the trusted mode runs the platform's own launchers only
    if on_host(t.model_path, t.engine) and not volume_allows(
        t.model_path, node.allowed_volume_prefixes, node.denied_volume_prefixes
    ):
        return VOLUME
    if t.host_paths:  # A2: the task's own volumes (core.volumes), on a node that mounts
        if node.runtime == "process":
            return NO_MOUNTS
        if any(
            not volume_allows(p, node.allowed_volume_prefixes, node.denied_volume_prefixes)
            for p in t.host_paths
        ):
            return HOST_VOLUME
    if t.gpu_required and (node.cpu_percent > thr or node.memory_percent > thr):
        return OVERLOADED
    if t.inference and node.inference_tasks >= cap:
        return CONTAINER_CAP
    return ""


def typed_cards(node: NodeView, t: TaskDemand) -> tuple[list[CardView], str]:
    """The node's cards of the task's type that its engine can drive (H1)."""
    if not node.cards:
        return [], NO_GPUS
    cards = node.cards if not t.gpu_type else [c for c in node.cards if c.model == t.gpu_type]
    if not cards:
        return [], TYPE_MISMATCH
    if t.engine_vendors:
        cards = [c for c in cards if c.vendor in t.engine_vendors]
        if not cards or node.cpu_build(t.engine):  # a CPU build drives no card
            return [], ENGINE_VENDOR
    return cards, ""


def cpu_room(node: NodeView, t: TaskDemand) -> tuple[int, int]:
    """(memory the CPU task books, free memory left for CPU tasks before it): what the
    platform has not booked of its share, and no more than the node reports really free
    (other programs' use counts; 0 = not reported, e.g. a declared inventory)."""
    need = t.memory_mb or DEFAULT_CPU_TASK_MEMORY_MB
    free = int(node.memory_total_mb * CPU_TASK_MEMORY_SHARE) - node.memory_committed_mb
    if node.memory_available_mb > 0:
        free = min(free, node.memory_available_mb - node.memory_unloaded_mb)
    return need, free


def ports_for(t: TaskDemand, node: NodeView, pool: range) -> tuple[int, ...] | None:
    """Requested host ports (0 = from the pool, P2); None when one is taken or the pool
    is exhausted."""
    taken = node.ports_in_use
    fixed = [hp for hp in t.host_ports if hp]
    if any(hp in taken for hp in fixed) or len(set(fixed)) != len(fixed):
        return None
    wanted = len(t.host_ports) - len(fixed)
    chosen: list[int] = []
    if wanted:
        skip = taken.union(fixed)
        for p in pool:
            if p not in skip:
                chosen.append(p)
                if len(chosen) == wanted:
                    break
        else:
            return None
    it = iter(chosen)
    return tuple(hp if hp else next(it) for hp in t.host_ports)
