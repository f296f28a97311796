"""Preemption (B4): when a task fits nowhere, which lower-priority tasks to move out.

Pure: it works on copies of the views and says (node, victims); the caller moves the
victims back to the queue through the state door and the waiting task takes the cards
once they are released. Only tasks of strictly lower priority are victims, never a
task already being preempted nor one created ``preemptible: false`` (A2), and only
inside the preemptor's reach (``may_preempt``: its tenant or sharing group, unless an
operator gave it the platform class); the choice minimises first the number of victims,
then the highest priority among them, then prefers the lowest-priority work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from heteroflow.core.placement.model import (
    NodeView,
    Occupant,
    Reservation,
    TaskDemand,
    unbook_occupant,
)
from heteroflow.core.placement.pipeline import Policy, evaluate


def may_preempt(t: TaskDemand, o: Occupant) -> bool:
    """Strictly lower priority, preemptible, not already moving, and within the task's
    reach: a tenant-class priority (every member's) ranks only inside its share key (its
    tenant, or its sharing group), so no tenant can push another off its cards by raising
    a number; a platform-class priority is an operator's decision and reaches everyone.
    A task created ``preemptible: false`` is never a victim, whoever asks."""
    if o.priority >= t.priority or o.preempting or not o.preemptible:
        return False
    return t.priority_class == "platform" or (bool(t.share_key) and o.share_key == t.share_key)


@dataclass(frozen=True, slots=True)
class Preemption:
    node_id: str
    victims: tuple[Occupant, ...]


def plan_preemption(
    t: TaskDemand,
    nodes: Iterable[NodeView],
    res: Reservation,
    pool: range,
    policy: Policy,
) -> Preemption | None:
    best: tuple[tuple[int, int], Preemption] | None = None
    for node in nodes:
        if not node.online:
            continue
        if t.gpu_type and not any(c.model == t.gpu_type for c in node.cards):
            continue
        if t.gpu_required and not node.cards:
            continue
        lower = sorted(
            (o for o in node.occupants if may_preempt(t, o)),
            key=lambda o: (o.priority, -o.per_card_pct),
        )
        if not lower:
            continue
        if best is not None and best[0] <= (1, lower[0].priority):
            continue  # any plan here moves >= 1 task of priority >= lower[0]'s: not better
        if not _could_fit(node, t, {o.task_id for o in lower}):
            continue
        if not any(o.sleeping for o in lower) and not _fits_without(node, t, lower, res, pool,
                                                                    policy):
            continue
        trial = node.clone()
        victims: list[Occupant] = []
        for o in lower:
            unbook_occupant(trial, o)
            victims.append(o)
            p, _, _ = evaluate(trial, t, res, pool, policy)
            if p is not None:
                victims = _trim(trial, node, victims, t, res, pool, policy)
                key = (len(victims), max(v.priority for v in victims))
                if best is None or key < best[0]:
                    best = (key, Preemption(node.id, tuple(victims)))
                break
    return best[1] if best else None


def _fits_without(
    node: NodeView,
    t: TaskDemand,
    movable: list[Occupant],
    res: Reservation,
    pool: range,
    policy: Policy,
) -> bool:
    """Does the task fit once every movable task has left? Room only grows as tasks
    leave (commitment, memory, holders, the container count; a sleeping occupant's
    borrow counters are the exception, so the caller asks only without one), so when
    this says no, no prefix of victims makes room: one evaluation instead of one per
    victim on the nodes that cannot be freed."""
    trial = node.clone()
    for o in movable:
        unbook_occupant(trial, o)
    return evaluate(trial, t, res, pool, policy)[0] is not None


def _could_fit(node: NodeView, t: TaskDemand, movable: set[str]) -> bool:
    """A cheap bound before any trial: enough cards of the type that are free or held
    only by movable tasks."""
    if t.gpu_required == 0:
        return True
    held: dict[int, bool] = {}
    for o in node.occupants:
        for g in o.gpu_ids:
            held[g] = held.get(g, True) and o.task_id in movable
    usable = sum(
        1
        for c in node.cards
        if (not t.gpu_type or c.model == t.gpu_type) and held.get(c.index, c.free)
    )
    return usable >= t.gpu_required


def _trim(
    trial: NodeView,
    node: NodeView,
    victims: list[Occupant],
    t: TaskDemand,
    res: Reservation,
    pool: range,
    policy: Policy,
) -> list[Occupant]:
    """Drop victims the task does not need gone (an early low-priority victim may sit on
    a card the task never uses)."""
    kept = list(victims)
    for v in list(victims[:-1]):
        attempt = node.clone()
        for o in kept:
            if o is not v:
                unbook_occupant(attempt, o)
        if evaluate(attempt, t, res, pool, policy)[0] is not None:
            kept.remove(v)
    return kept
