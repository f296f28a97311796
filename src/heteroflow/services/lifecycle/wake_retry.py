"""The leader's wake round (F3): requested wakes that could not happen at once, retried
until they can (or their node is lost), gangs woken whole. Split from ``sleep`` (which
holds the wake itself and its blockers) by size; ``controllers/wakes.py`` runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Node, Task, TaskGroup
from heteroflow.services.lifecycle.sleep import (
    _blocker,
    _current_tasks,
    _defer,
    _defer_gang,
    _set_wake_requested,
)
from heteroflow.services.lifecycle.transitions import transition

T = TaskStatus


@dataclass
class WakeRound:
    """What one ``retry_wakes`` round did (task ids)."""

    woken: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)


def retry_wakes(
    s: Session, clock: Clock, *, offline_after_s: float, node_lost_after_s: float
) -> WakeRound:
    """One level-triggered round over requested wakes (F3) and waking tasks.

    A sleeping task with ``wake_requested``: woken once its node is online and its cards
    free; failed (so the recovery loop rebuilds it elsewhere) once its node has had no
    heartbeat for ``node_lost_after_s``; else it keeps waiting, its reason kept current.
    A waking task whose node has been gone that long is failed too (no agent will ever
    report it)."""
    now = clock.now()
    out = WakeRound()
    q = (
        select(Task)
        .where(
            or_(
                and_(Task.wake_requested.is_(True), Task.status == T.SLEEPING.value),
                Task.status == T.WAKING.value,
            )
        )
        .order_by(Task.created_at)
    )
    gangs: dict[str, None] = {}
    for t in list(s.scalars(q)):
        if t.status == T.SLEEPING.value and _is_gang(s, t):
            gangs[t.group_id] = None  # a gang wakes whole: below
            continue
        node = s.get(Node, t.node_id) if t.node_id else None
        gone_s = (now - node.last_heartbeat_at).total_seconds() if node is not None else None
        lost = gone_s is None or gone_s > node_lost_after_s
        status = T(t.status)
        name = node.name if node is not None else str(t.node_id)
        if status == T.WAKING:
            if lost and transition(
                s, clock, t.id, T.WAKING, T.FAILED,
                f"node {name} lost while the task was waking (no heartbeat for "
                f"{gone_s or 0:.0f} s); failed so the service is rebuilt elsewhere",
            ):
                out.failed.append(t.id)
            continue
        blocked = _blocker(s, now, t, offline_after_s)
        if blocked is None:
            if transition(
                s, clock, t.id, T.SLEEPING, T.WAKING,
                "woken: the wake requested earlier can happen now",
            ):
                _set_wake_requested(s, t.id, T.WAKING, False)
                out.woken.append(t.id)
        elif blocked[0] == "node_offline" and lost:
            if transition(
                s, clock, t.id, T.SLEEPING, T.FAILED,
                f"wake requested, but node {name} has had no heartbeat for "
                f"{gone_s or 0:.0f} s; failed so the service is rebuilt elsewhere",
            ):
                out.failed.append(t.id)
        else:
            _defer(s, clock, t, blocked[1])
            out.waiting.append(t.id)
    for group_id in gangs:
        _retry_gang(
            s, clock, _current_tasks(s, group_id), out,
            offline_after_s=offline_after_s, node_lost_after_s=node_lost_after_s,
        )
    return out


def _is_gang(s: Session, t: Task) -> bool:
    g = s.get(TaskGroup, t.group_id)
    return g is not None and g.parallelism == "pipeline" and not t.replaced_by


def _retry_gang(
    s: Session, clock: Clock, stages: list[Task], out: WakeRound, *,
    offline_after_s: float, node_lost_after_s: float,
) -> None:
    """A gang whose wake was requested: woken whole once no stage is blocked; a stage
    whose node has been gone ``node_lost_after_s`` is failed (the recovery loop then
    rebuilds the gang as one, elsewhere); else it keeps waiting, said once."""
    now = clock.now()
    asleep = [t for t in stages if t.status == T.SLEEPING.value]
    if not any(t.wake_requested for t in asleep):
        return
    for t in asleep:
        blocked = _blocker(s, now, t, offline_after_s)
        if blocked is None:
            continue
        node = s.get(Node, t.node_id) if t.node_id else None
        gone_s = (now - node.last_heartbeat_at).total_seconds() if node is not None else None
        if blocked[0] == "node_offline" and (gone_s is None or gone_s > node_lost_after_s):
            name = node.name if node is not None else str(t.node_id)
            if transition(
                s, clock, t.id, T.SLEEPING, T.FAILED,
                f"gang wake requested, but node {name} of stage {t.rank} has had no "
                f"heartbeat for {gone_s or 0:.0f} s; failed so the gang is rebuilt elsewhere",
            ):
                out.failed.append(t.id)
            return
        _defer_gang(s, clock, asleep, t, blocked[1])
        out.waiting.extend(x.id for x in asleep)
        return
    for t in asleep:
        if not transition(
            s, clock, t.id, T.SLEEPING, T.WAKING,
            "woken with its gang: the wake requested earlier can happen now",
        ):
            raise Conflict(f"stage {t.rank} of the gang ({t.id}) changed state; retry")
        _set_wake_requested(s, t.id, T.WAKING, False)
        out.woken.append(t.id)
