"""Draining a replica (M11): the gateway gives it no new requests; in-flight ones finish.

The mark is ``tasks.draining``; the routing snapshot carries it to every gateway within
one publish interval (plus one poll for a separate gateway), and the balancer never
chooses a draining backend, sticky sessions included. Requests already on it are not
touched: nothing here stops the task or its engine. The rolling update marks the old
generation this way before stopping it; an operator or member can do the same by hand
(``POST /api/v1/tasks/{id}/drain``) and clear it (``DELETE``). Each change is one
``events`` row on the group's timeline.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict
from heteroflow.core.states import TERMINAL, TaskStatus
from heteroflow.db.tables import Event, Task
from heteroflow.schemas.task_groups import TaskRead
from heteroflow.services.identity.access import visible_task
from heteroflow.services.identity.auth import Principal
from heteroflow.services.views import task_read

DRAIN = "drain"
UNDRAIN = "undrain"


def set_draining(
    s: Session, who: Principal, clock: Clock, task_id: str, draining: bool
) -> TaskRead:
    """Mark (or clear) ``task_id`` as draining; idempotent. 404 for tasks ``who`` cannot see,
    409 when marking a task that has already ended."""
    t = visible_task(s, who, task_id)
    if draining and TaskStatus(t.status) in TERMINAL:
        raise Conflict(f"task {task_id!r} is {t.status}: there is nothing left to drain")
    if bool(t.draining) != draining:
        mark(s, clock, t, draining, f"by {who.username}")
        s.flush()
    return task_read(t)


def mark(s: Session, clock: Clock, t: Task, draining: bool, why: str) -> None:
    """Set the flag and write the timeline row in the caller's unit of work."""
    t.draining = draining
    t.updated_at = clock.now()
    s.add(
        Event(
            group_id=t.group_id,
            task_id=t.id,
            kind=DRAIN if draining else UNDRAIN,
            from_status=t.status,
            to_status=t.status,
            message=("draining " if draining else "draining cleared ") + why,
            created_at=clock.now(),
        )
    )
