"""Scheduler v1 placement: pure filters and a scorer over plain values (no I/O).

A card admits a GPU task only if (a) the memory commitments (``gpu_memory_utilization``,
percent of the card) of the tasks on it, this one included, sum to at most 100, and
(b) when the task's memory estimate is known, it fits the card's available memory (B3):
total - max(reported used, estimates of our tasks on it) - reservation, where
reservation = fixed (default 500 MB) + ratio (default 10%) of total. An unknown
estimate skips (b), as the create-time precheck does. CPU tasks (``gpu_required: 0``) are placed
by node memory and CPU count. Host ports with ``host_port: 0`` come from the port pool.

The full pipeline (type/locality/engine preferences, load threshold, scoring plugins,
commitment admission, tenants, gangs, preemption) extends this module's shape: each
filter returns the nodes that pass plus the reason the others failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CPU_TASK_MEMORY_MB = 1024


@dataclass(frozen=True, slots=True)
class Reservation:
    fixed_mb: int = 500
    ratio: float = 0.10

    def of(self, total_mb: int) -> int:
        return self.fixed_mb + int(total_mb * self.ratio)


@dataclass(slots=True)
class CardView:
    index: int
    vendor: str
    model: str
    memory_total_mb: int
    memory_used_mb: int = 0
    committed_mb: int = 0
    committed_pct: int = 0

    def available_mb(self, reservation: Reservation) -> int:
        used = max(self.memory_used_mb, self.committed_mb)
        return self.memory_total_mb - used - reservation.of(self.memory_total_mb)


@dataclass(slots=True)
class NodeView:
    id: str
    name: str
    online: bool
    cards: list[CardView]
    cpu_count: int
    memory_total_mb: int
    memory_committed_mb: int = 0
    ports_in_use: set[int] = field(default_factory=set)
    cpu_percent: float = 0.0
    memory_percent: float = 0.0
    inference_tasks: int = 0  # placed inference containers (sleeping ones count too)
    models: frozenset[str] = frozenset()  # paths and names of the models it holds
    engines: frozenset[str] = frozenset()  # engines its probe reports available


@dataclass(frozen=True, slots=True)
class TaskDemand:
    task_id: str
    gpu_required: int
    gpu_type: str
    gpu_memory_utilization: int  # 1-100
    estimated_gpu_memory_mb: int
    memory_mb: int
    host_ports: tuple[int, ...]  # requested host ports, 0 = from the pool
    inference: bool = False
    model_path: str = ""
    engine: str = ""


@dataclass(frozen=True, slots=True)
class Policy:
    """Per-cluster knobs of the pipeline (B1)."""

    load_threshold_pct: float = 90.0  # a node busier than this (CPU or memory) is skipped
    inference_cap: int = 8  # inference containers per node


@dataclass(frozen=True, slots=True)
class Placement:
    node_id: str
    gpu_ids: tuple[int, ...]
    per_card_mb: int
    memory_mb: int
    host_ports: tuple[int, ...]
    per_card_pct: int = 0


@dataclass(frozen=True, slots=True)
class Unplaced:
    reason: str


def admits(card: CardView, task: TaskDemand, res: Reservation) -> str:
    """"" when the card admits the task, else why not (a reason key)."""
    if card.committed_pct + task.gpu_memory_utilization > 100:
        return "commitment_full"
    if task.estimated_gpu_memory_mb and task.estimated_gpu_memory_mb > card.available_mb(res):
        return "vram_short"
    return ""


def _ports(task: TaskDemand, node: NodeView, pool: range) -> tuple[int, ...] | None:
    taken = set(node.ports_in_use)
    chosen: list[int] = []
    for hp in task.host_ports:
        if hp:
            if hp in taken:
                return None
            taken.add(hp)
            chosen.append(hp)
    free = (p for p in pool if p not in taken)
    out: list[int] = []
    for hp in task.host_ports:
        if hp:
            out.append(hp)
        else:
            nxt = next(free, None)
            if nxt is None:
                return None
            out.append(nxt)
    return tuple(out)


def _fit_gpu(task: TaskDemand, node: NodeView, res: Reservation) -> tuple[list[CardView], str]:
    if not node.cards:
        return [], "no_gpus"
    cards = [c for c in node.cards if not task.gpu_type or c.model == task.gpu_type]
    if not cards:
        return [], "gpu_type_mismatch"
    verdicts = [(c, admits(c, task, res)) for c in cards]
    fitting = [c for c, why in verdicts if not why]
    if len(fitting) < task.gpu_required:
        whys = {why for _, why in verdicts if why}
        return [], "vram_short" if "vram_short" in whys else "commitment_full"
    # binpack inside the node: fullest cards that still fit first, keeping whole cards free
    fitting.sort(key=lambda c: (c.available_mb(res), c.index))
    return fitting[: task.gpu_required], ""


def place(
    task: TaskDemand,
    nodes: list[NodeView],
    res: Reservation,
    pool: range,
    policy: Policy = Policy(),  # frozen: a shared default is safe
) -> Placement | Unplaced:
    """Choose a node (and cards) for one task, or say precisely why none fits.

    Filters: online, host ports, load threshold, inference container cap, then memory
    (CPU tasks) or cards (GPU tasks). Among the nodes left, a node that already holds
    the model wins, then one that reports the task's engine, then binpack (GPU) or the
    most free memory (CPU).
    """
    counts: dict[str, int] = {}
    best: tuple[tuple[int, int, int], Placement] | None = None
    for node in nodes:
        if not node.online:
            counts["offline"] = counts.get("offline", 0) + 1
            continue
        thr = policy.load_threshold_pct
        if node.cpu_percent > thr or node.memory_percent > thr:
            counts["overloaded"] = counts.get("overloaded", 0) + 1
            continue
        if task.inference and node.inference_tasks >= policy.inference_cap:
            counts["container_cap"] = counts.get("container_cap", 0) + 1
            continue
        ports = _ports(task, node, pool)
        if ports is None:
            counts["ports"] = counts.get("ports", 0) + 1
            continue
        if task.gpu_required == 0:
            need = task.memory_mb or DEFAULT_CPU_TASK_MEMORY_MB
            free = int(node.memory_total_mb * 0.9) - node.memory_committed_mb
            if node.cpu_count < 1 or free < need:
                counts["memory_short"] = counts.get("memory_short", 0) + 1
                continue
            score = free - need  # spread CPU work: most free memory wins
            cand = Placement(node.id, (), 0, need, ports)
        else:
            cards, why = _fit_gpu(task, node, res)
            if why:
                counts[why] = counts.get(why, 0) + 1
                continue
            score = -sum(c.available_mb(res) for c in cards)  # binpack across nodes
            cand = Placement(
                node.id,
                tuple(c.index for c in cards),
                task.estimated_gpu_memory_mb,
                0,
                ports,
                per_card_pct=task.gpu_memory_utilization,
            )
        local = int(bool(task.model_path) and task.model_path in node.models)
        engine = int(bool(task.engine) and task.engine in node.engines)
        key = (local, engine, score)
        if best is None or key > best[0]:
            best = (key, cand)
    if best is not None:
        return best[1]
    return Unplaced(_reason(task, nodes, counts, policy))


def _reason(
    task: TaskDemand, nodes: list[NodeView], counts: dict[str, int], policy: Policy
) -> str:
    if not nodes:
        return "InsufficientResources: no node has registered"
    parts = []
    labels = {
        "offline": "offline",
        "no_gpus": "no GPU cards",
        "gpu_type_mismatch": f"no card of type {task.gpu_type!r}",
        "vram_short": f"fewer than {task.gpu_required} card(s) with "
        f"{task.estimated_gpu_memory_mb} MB free after the reservation",
        "commitment_full": f"fewer than {task.gpu_required} card(s) with "
        f"{task.gpu_memory_utilization}% of memory commitment left",
        "memory_short": f"not {task.memory_mb or DEFAULT_CPU_TASK_MEMORY_MB} MB of free "
        "memory for a CPU task",
        "ports": "requested host port in use or port pool exhausted",
        "overloaded": f"CPU or memory use above {policy.load_threshold_pct:g}%",
        "container_cap": f"already {policy.inference_cap} inference containers "
        "(sleeping services count)",
    }
    for key, n in sorted(counts.items()):
        parts.append(f"{n} node(s): {labels[key]}")
    return f"InsufficientResources: 0/{len(nodes)} nodes fit — " + "; ".join(parts)


def commit(node: NodeView, placement: Placement, *, inference: bool = False) -> None:
    """Book a placement into the in-memory views so the same round does not double-book."""
    node.inference_tasks += int(inference)
    for c in node.cards:
        if c.index in placement.gpu_ids:
            c.committed_mb += placement.per_card_mb
            c.committed_pct += placement.per_card_pct
    node.memory_committed_mb += placement.memory_mb
    node.ports_in_use.update(placement.host_ports)


def never_fits(task: TaskDemand, nodes: list[NodeView], res: Reservation) -> str:
    """Why no registered node could hold the task even when idle ("" = some node could).

    The create-time precheck (B8): capacity, not current use, and offline nodes count
    too. With no node of the kind the task needs registered yet, nothing is refused.
    """
    if task.gpu_required == 0:
        if not nodes:
            return ""
        need = task.memory_mb or DEFAULT_CPU_TASK_MEMORY_MB
        best = max(int(n.memory_total_mb * 0.9) for n in nodes)
        if best >= need:
            return ""
        return f"the largest node offers {best} MB to CPU tasks, {need} MB needed"
    gpu_nodes = [n for n in nodes if n.cards]
    if not gpu_nodes or not task.estimated_gpu_memory_mb:
        return ""
    need = task.estimated_gpu_memory_mb
    best_per_node = []
    for n in gpu_nodes:
        cards = [c for c in n.cards if not task.gpu_type or c.model == task.gpu_type]
        usable = sorted(
            (c.memory_total_mb - res.of(c.memory_total_mb) for c in cards), reverse=True
        )
        if len(usable) >= task.gpu_required and usable[task.gpu_required - 1] >= need:
            return ""
        if len(usable) >= task.gpu_required:
            best_per_node.append(usable[task.gpu_required - 1])
    if not best_per_node:
        return f"no registered node has {task.gpu_required} card(s)" + (
            f" of type {task.gpu_type!r}" if task.gpu_type else ""
        )
    return (
        f"{need} MB per card on {task.gpu_required} card(s), but the best node offers "
        f"{max(best_per_node)} MB per card after the reservation"
    )
