"""Failure memo for one scheduler round: a demand no larger than one that already
failed cannot fit either (bookings only grow within a round).

Feasibility is monotone in every size of a demand — cards, commitment, memory
estimate, host memory — for a fixed kind (GPU type, task type, tenant key, whole or
shared, requested ports). So the memo keeps, per kind, the failed sizes, and answers
"fails" for any demand that dominates one of them, re-explaining the recorded node
counts with the new demand's own numbers. This keeps unplaceable tasks from costing a
full fleet scan each on a large cluster.
"""

from __future__ import annotations

from collections.abc import Hashable

from heteroflow.core.paths import on_host
from heteroflow.core.placement.model import TaskDemand, Unplaced
from heteroflow.core.placement.reasons import explain

_MAX_PER_KIND = 64  # the smallest failures are kept; they dominate the most


class FailureMemo:
    def __init__(self, thr: float, cap: int) -> None:
        self._thr, self._cap = thr, cap
        self._failed: dict[Hashable, list[tuple[tuple[int, int, int, int], Unplaced, int]]] = {}

    @staticmethod
    def _kind(t: TaskDemand, extra: Hashable) -> Hashable:
        volume = t.model_path if on_host(t.model_path, t.engine) else ""  # nodes' C4 rules
        return (t.gpu_type, t.task_type, t.share_key, t.tenant_id, t.whole, t.host_ports,
                t.engine_vendors, t.needs_container, t.priority_class, volume, t.host_paths,
                extra)

    @staticmethod
    def _size(t: TaskDemand) -> tuple[int, int, int, int]:
        return (t.gpu_required, t.gpu_memory_utilization, t.estimated_gpu_memory_mb,
                t.memory_mb)

    def lookup(self, t: TaskDemand, extra: Hashable = None) -> tuple[Unplaced, int] | None:
        """(why it fails, the highest priority that found no preemption) or None."""
        size = self._size(t)
        for failed, u, prio in self._failed.get(self._kind(t, extra), ()):
            if all(a >= b for a, b in zip(size, failed, strict=True)):
                why = explain(t, u.seen, dict(u.counts), self._thr, self._cap) if u.counts else (
                    u.reason
                )
                return Unplaced(why, u.seen, u.counts), prio
        return None

    def record(self, t: TaskDemand, u: Unplaced, prio: int, extra: Hashable = None) -> None:
        entries = self._failed.setdefault(self._kind(t, extra), [])
        size = self._size(t)
        entries[:] = [e for e in entries if e[0] != size]
        entries.append((size, u, prio))
        if len(entries) > _MAX_PER_KIND:
            entries.sort(key=lambda e: e[0])
            del entries[_MAX_PER_KIND:]
