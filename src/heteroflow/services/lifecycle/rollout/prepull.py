"""A recreate's pre-pull (J2, H7): the new image made present on the node of every old
replica before any of them drains (core/rollout/forward.py decides from the answers).

The server asks through the agent's own poll (``asks``: ``GET /api/v1/agent/prepulls``,
with the pull's login as a claim carries it); the agent pulls with the launch's own
puller and answers per replica (``record``: a ``rollout.prepull`` event on it, the
outcome in ``to_status``), which ``reads.replicas`` gives the machine. A replica keeps
being asked until its agent answered ``pulled`` or ``unavailable`` during this update; a
``failed`` pull (may heal) is tried again by the agent after a pause.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.events import EventKind
from heteroflow.core.rollout import RolloutState, progress_from_json
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.schemas.prepull import PrepullReport

# placed, and not on its way out: its node's agent can pull for it
_PLACED = [
    s.value for s in (
        TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.SLEEPING,
        TaskStatus.WAKING,
    )
]
_FINAL = ("pulled", "unavailable")


def _asked(
    s: Session, where: Sequence[ColumnElement[bool]]
) -> list[tuple[str, str, datetime | None]]:
    """(task id, image, update started) of the old replicas a recreate asks a pull for."""
    rows = s.execute(
        select(Task.id, Task.generation, TaskGroup.rollout_spec, TaskGroup.rollout_started_at)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(
            *where,
            Task.replaced_by == "",
            Task.status.in_(_PLACED),
            TaskGroup.rolling_update_state == RolloutState.RECREATING.value,
            TaskGroup.rollout_holder != "",
        )
    )
    out = []
    for tid, generation, spec, started in rows:
        try:
            p = progress_from_json(spec)
        except (KeyError, ValueError):
            continue
        if p.prepull_image and not p.prepulled and generation != p.generation:
            out.append((str(tid), p.prepull_image, started))
    return out


def asks(s: Session, node_id: str) -> list[tuple[str, str]]:
    """(task id, image) for each old replica on ``node_id`` whose service's recreate is
    in its pre-pull and whose agent has not answered it for good during this update."""
    asked = _asked(s, [Task.node_id == node_id])
    if not asked:
        return []
    answered: dict[str, datetime] = {}
    for tid, at in s.execute(
        select(Event.task_id, Event.created_at).where(
            Event.task_id.in_([a[0] for a in asked]),
            Event.kind == EventKind.ROLLOUT_PREPULL.value,
            Event.to_status.in_(_FINAL),
        )
    ):
        answered[str(tid)] = max(at, answered.get(str(tid), at))
    return [
        (tid, image) for tid, image, started in asked
        if not (tid in answered and (started is None or answered[tid] >= started))
    ]


def record(s: Session, clock: Clock, node_id: str, task_id: str, rep: PrepullReport) -> None:
    """The agent's answer for one replica: 404 for a task not on its node, 409 when no
    pre-pull of that image is asked of it (any more)."""
    t = s.get(Task, task_id)
    if t is None or not node_id or t.node_id != node_id:
        raise NotFound(f"task {task_id!r} is not placed on node {node_id!r}")
    if not any(image == rep.image for _, image, _ in _asked(s, [Task.id == task_id])):
        raise Conflict(f"no pre-pull of {rep.image} is asked for task {task_id} (any more)")
    s.add(
        Event(
            group_id=t.group_id, task_id=t.id, kind=EventKind.ROLLOUT_PREPULL.value,
            to_status=rep.outcome, message=rep.message or f"{rep.outcome}: {rep.image}",
            created_at=clock.now(), node_id=node_id,
        )
    )
