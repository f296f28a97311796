"""The one door for task state changes: compare-and-set plus an event row.

Every change of ``tasks.status`` in the code base goes through ``transition``. It runs
``UPDATE tasks SET status=:to WHERE id=:id AND status=:expected``; when another actor
changed the row first, nothing is written and False comes back — the caller re-reads
and decides again (level-triggered), so two servers or a server and an agent can never
both win the same change. The group's derived status is refreshed in the same unit of
work.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.states import TaskStatus, can_transition, group_status
from heteroflow.db.tables import Event, Task, TaskGroup


class IllegalTransition(Exception):
    pass


def transition(
    s: Session,
    clock: Clock,
    task_id: str,
    expected: TaskStatus,
    to: TaskStatus,
    message: str = "",
    **values: Any,
) -> bool:
    if not can_transition(expected, to):
        raise IllegalTransition(f"task cannot go from {expected} to {to}")
    now = clock.now()
    result = s.execute(
        update(Task)
        .where(Task.id == task_id, Task.status == expected.value)
        .values(status=to.value, status_message=message, updated_at=now, **values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    group_id = s.scalar(select(Task.group_id).where(Task.id == task_id))
    s.add(
        Event(
            group_id=group_id,
            task_id=task_id,
            kind="task_status",
            from_status=expected.value,
            to_status=to.value,
            message=message,
            created_at=now,
        )
    )
    if group_id is not None:
        refresh_group_status(s, clock, group_id, message)
    return True


def refresh_group_status(s: Session, clock: Clock, group_id: str, message: str = "") -> None:
    group = s.get(TaskGroup, group_id, populate_existing=True)
    if group is None:
        return
    statuses = [
        TaskStatus(v) for v in s.scalars(select(Task.status).where(Task.group_id == group_id))
    ]
    new = group_status(statuses, deleting=group.deleted_at is not None).value
    if new != group.status:
        s.add(
            Event(
                group_id=group_id,
                task_id=None,
                kind="group_status",
                from_status=group.status,
                to_status=new,
                message=message,
                created_at=clock.now(),
            )
        )
        group.status = new
        group.status_message = message
        group.updated_at = clock.now()


def set_pending_reason(s: Session, clock: Clock, task_id: str, reason: str) -> None:
    """Record why a task is still queued (no state change, so no event)."""
    s.execute(
        update(Task)
        .where(Task.id == task_id, Task.status == TaskStatus.PENDING.value)
        .values(status_message=reason)
        .execution_options(synchronize_session=False)
    )
