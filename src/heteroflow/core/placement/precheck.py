"""The create-time precheck (B8): could any registered node ever hold the task?"""

from __future__ import annotations

from heteroflow.core.placement.model import (
    CPU_TASK_MEMORY_SHARE,
    DEFAULT_CPU_TASK_MEMORY_MB,
    NodeView,
    Reservation,
    TaskDemand,
)


def never_fits(task: TaskDemand, nodes: list[NodeView], res: Reservation) -> str:
    """Why no registered node could hold the task even when idle ("" = some node could).

    Capacity, not current use, and offline nodes count too. With no node of the kind
    the task needs registered yet, nothing is refused.
    """
    if task.gpu_required == 0:
        if not nodes:
            return ""
        need = task.memory_mb or DEFAULT_CPU_TASK_MEMORY_MB
        best = max(int(n.memory_total_mb * CPU_TASK_MEMORY_SHARE) for n in nodes)
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
