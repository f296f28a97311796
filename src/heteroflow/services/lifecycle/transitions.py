"""The one door for task state changes: compare-and-set plus an event row.

Every change of ``tasks.status`` in the code base goes through ``transition``. It runs
``UPDATE tasks SET status=:to WHERE id=:id AND status=:expected``; when another actor
changed the row first, nothing is written and False comes back — the caller re-reads
and decides again (level-triggered), so two servers or a server and an agent can never
both win the same change. The group's derived status is refreshed in the same unit of
work. ``transition_many`` is the same door for a batch (the scheduler's commits). A move
between GPU-time buckets (running, sleeping, none) also closes and opens the tasks'
segments (N4, ``services/tenancy/gpu_time.py``).

What else a change writes is a ``TaskUpdate``: typed, optional fields, one per column a
state change may set (placement, preemption, start time); a field left ``UNSET`` is not
written. Its constructor checks the types at run time too, so a wrong value fails where
it is made, not inside the UPDATE.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from enum import Enum
from typing import Any, Final, cast

from sqlalchemy import Table, bindparam, insert, select
from sqlalchemy import update as sql_update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.events import EventKind
from heteroflow.core.metering import metered_state
from heteroflow.core.ports import PortMapping, ports_to_dicts
from heteroflow.core.states import TaskStatus, can_transition, group_status
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.services.tenancy import gpu_time

_TASKS = cast(Table, Task.__table__)
_GROUPS = cast(Table, TaskGroup.__table__)
_CHUNK = 1000  # ids per IN (...) list


class IllegalTransition(Exception):
    pass


class _Unset(Enum):
    UNSET = "unset"


UNSET: Final = _Unset.UNSET  # "leave this column as it is"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


# TaskUpdate's run-time check: field -> (the type in words, the test)
_CHECKS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "node_id": ("str | None", lambda v: v is None or isinstance(v, str)),
    "gpu_ids": ("tuple[int, ...]", lambda v: isinstance(v, tuple) and all(map(_is_int, v))),
    "ports": (
        "tuple[PortMapping, ...]",
        lambda v: isinstance(v, tuple) and all(isinstance(p, PortMapping) for p in v),
    ),
    "memory_mb": ("int", _is_int),
    "qos": ("str", _is_str),
    "engine": ("str", _is_str),
    "engine_reason": ("str", _is_str),
    "preempted_by": ("str", _is_str),
    "started_at": ("datetime | None", lambda v: v is None or isinstance(v, datetime)),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskUpdate:
    """The task columns a state change sets besides its status; ``UNSET`` = untouched."""

    node_id: str | _Unset | None = UNSET  # None: off its node (back to the queue)
    gpu_ids: tuple[int, ...] | _Unset = UNSET
    ports: tuple[PortMapping, ...] | _Unset = UNSET
    memory_mb: int | _Unset = UNSET
    qos: str | _Unset = UNSET
    engine: str | _Unset = UNSET
    engine_reason: str | _Unset = UNSET
    preempted_by: str | _Unset = UNSET
    started_at: datetime | _Unset | None = UNSET

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want, ok = _CHECKS[f.name]
            if value is not UNSET and not ok(value):
                raise TypeError(f"TaskUpdate.{f.name} must be {want}, not {value!r}")

    def columns(self) -> dict[str, Any]:
        """The set fields as column values (tuples become the JSON columns' lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is UNSET:
                continue
            if f.name == "ports":
                value = ports_to_dicts(value)
            elif f.name == "gpu_ids":
                value = list(value)
            out[f.name] = value
        return out


KEEP: Final = TaskUpdate()  # a change of status only


@dataclass(frozen=True, slots=True)
class Move:
    """One task's change in a batch: its event message and the columns it sets."""

    task_id: str
    group_id: str
    message: str
    update: TaskUpdate = KEEP


def transition(
    s: Session,
    clock: Clock,
    task_id: str,
    expected: TaskStatus,
    to: TaskStatus,
    message: str = "",
    *,
    update: TaskUpdate = KEEP,
) -> bool:
    if not isinstance(update, TaskUpdate):
        raise TypeError(f"update must be a TaskUpdate, not {type(update).__name__}")
    if not can_transition(expected, to):
        raise IllegalTransition(f"task cannot go from {expected} to {to}")
    now = clock.now()
    result = s.execute(
        sql_update(Task)
        .where(Task.id == task_id, Task.status == expected.value)
        .values(
            status=to.value, status_message=message, updated_at=now,
            **_stamps(to, now), **update.columns(),
        )
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    group_id = s.scalar(select(Task.group_id).where(Task.id == task_id))
    _meter(s, now, [task_id], expected, to)
    s.add(
        Event(
            group_id=group_id,
            task_id=task_id,
            kind=EventKind.TASK_STATUS,
            from_status=expected.value,
            to_status=to.value,
            message=message,
            created_at=now,
        )
    )
    if group_id is not None:
        refresh_group_status(s, clock, group_id, message)
    return True


def note(
    s: Session,
    clock: Clock,
    task_id: str,
    expected: TaskStatus,
    kind: EventKind | None,
    message: str,
    node_id: str | None = None,
) -> bool:
    """A fact about a task that does not change its state (a launch retried, and why):
    its status message and an event of ``kind`` (None: the status message alone — D5's
    load progress, said every few seconds), only while it is still ``expected``."""
    now = clock.now()
    result = s.execute(
        sql_update(Task)
        .where(Task.id == task_id, Task.status == expected.value)
        .values(status_message=message, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return False
    if kind is None:
        return True
    group_id = s.scalar(select(Task.group_id).where(Task.id == task_id))
    s.add(
        Event(
            group_id=group_id, task_id=task_id, kind=kind, message=message,
            created_at=now, node_id=node_id,
        )
    )
    return True


def _meter(
    s: Session, now: datetime, task_ids: list[str], expected: TaskStatus, to: TaskStatus
) -> None:
    """GPU time (N4): a move between metered buckets closes and opens segments."""
    src, dst = metered_state(expected), metered_state(to)
    if src != dst:
        gpu_time.record(s, now, task_ids, src, dst)


def _stamps(to: TaskStatus, now: datetime) -> dict[str, Any]:
    """Columns a state sets by itself: ``running_at`` when a task becomes running (E1's
    stability window and A10's run timeout count from there)."""
    return {"running_at": now} if to == TaskStatus.RUNNING else {}


def refresh_group_status(s: Session, clock: Clock, group_id: str, message: str = "") -> None:
    """The group's status from its current tasks (a task another replaced is history)."""
    group = s.get(TaskGroup, group_id, populate_existing=True)
    if group is None:
        return
    statuses = [
        TaskStatus(v)
        for v in s.scalars(
            select(Task.status).where(Task.group_id == group_id, Task.replaced_by == "")
        )
    ]
    new = group_status(statuses, deleting=group.deleted_at is not None).value
    if new != group.status:
        s.add(
            Event(
                group_id=group_id,
                task_id=None,
                kind=EventKind.GROUP_STATUS,
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
        sql_update(Task)
        .where(Task.id == task_id, Task.status == TaskStatus.PENDING.value)
        .values(status_message=reason)
        .execution_options(synchronize_session=False)
    )


def transition_many(
    s: Session,
    clock: Clock,
    expected: TaskStatus,
    to: TaskStatus,
    moves: Sequence[Move],
    *,
    rows_locked: bool = False,
    group_message: str = "",
) -> set[str]:
    """``transition`` for a batch (the scheduler's commits): the same compare-and-set per
    task, one executemany instead of a round trip each; returns the ids that moved.

    Every move must set the same columns. With ``rows_locked`` (the caller holds the rows
    FOR UPDATE, PostgreSQL) every row moves; otherwise a read confirms which did.
    """
    if not can_transition(expected, to):
        raise IllegalTransition(f"task cannot go from {expected} to {to}")
    if not moves:
        return set()
    now = clock.now()
    values = [m.update.columns() for m in moves]
    keys = list(values[0])
    if any(v.keys() != values[0].keys() for v in values):
        raise ValueError("transition_many: every move must set the same columns")
    s.execute(
        sql_update(_TASKS)
        .where(_TASKS.c.id == bindparam("b_id"), _TASKS.c.status == expected.value)
        .values(
            status=to.value,
            status_message=bindparam("b_msg"),
            updated_at=now,
            **_stamps(to, now),
            **{k: bindparam(f"b_{k}") for k in keys},
        ),
        [
            {"b_id": m.task_id, "b_msg": m.message, **{f"b_{k}": v[k] for k in keys}}
            for m, v in zip(moves, values, strict=True)
        ],
    )
    ids = [m.task_id for m in moves]
    moved = set(ids) if rows_locked else _ids_in(s, ids, to)
    done = [m for m in moves if m.task_id in moved]
    if done:
        _meter(s, now, [m.task_id for m in done], expected, to)
        s.execute(
            insert(Event),
            [
                {
                    "group_id": m.group_id, "task_id": m.task_id,
                    "kind": EventKind.TASK_STATUS.value,
                    "from_status": expected.value, "to_status": to.value,
                    "message": m.message, "created_at": now,
                }
                for m in done
            ],
        )
        refresh_group_statuses(s, clock, {m.group_id for m in done}, group_message)
    return moved


def _ids_in(s: Session, ids: list[str], status: TaskStatus) -> set[str]:
    out: set[str] = set()
    for i in range(0, len(ids), _CHUNK):
        q = select(Task.id).where(Task.id.in_(ids[i : i + _CHUNK]), Task.status == status.value)
        out.update(s.scalars(q))
    return out


def refresh_group_statuses(
    s: Session, clock: Clock, group_ids: set[str], message: str = ""
) -> None:
    """``refresh_group_status`` for many groups: one read, one executemany, events."""
    ids = sorted(group_ids)
    statuses: dict[str, list[TaskStatus]] = defaultdict(list)
    current: dict[str, tuple[str, bool]] = {}
    for i in range(0, len(ids), _CHUNK):
        q = (
            select(Task.group_id, Task.status, TaskGroup.status, TaskGroup.deleted_at)
            .join(TaskGroup, TaskGroup.id == Task.group_id)
            .where(Task.group_id.in_(ids[i : i + _CHUNK]), Task.replaced_by == "")
        )
        for gid, st, group_st, deleted in s.execute(q):
            statuses[gid].append(TaskStatus(st))
            current[gid] = (group_st, deleted is not None)
    changes = []
    for gid, (old, deleting) in current.items():
        new = group_status(statuses[gid], deleting=deleting).value
        if new != old:
            changes.append({"b_id": gid, "b_status": new, "b_old": old})
    if not changes:
        return
    now = clock.now()
    s.execute(
        sql_update(_GROUPS)
        .where(_GROUPS.c.id == bindparam("b_id"), _GROUPS.c.status == bindparam("b_old"))
        .values(status=bindparam("b_status"), status_message=message, updated_at=now),
        changes,
    )
    s.execute(
        insert(Event),
        [
            {
                "group_id": c["b_id"], "task_id": None,
                "kind": EventKind.GROUP_STATUS.value,
                "from_status": c["b_old"], "to_status": c["b_status"], "message": message,
                "created_at": now,
            }
            for c in changes
        ],
    )


def set_pending_reasons(s: Session, reasons: dict[str, str]) -> None:
    """``set_pending_reason`` for many tasks in one executemany."""
    if not reasons:
        return
    s.execute(
        sql_update(_TASKS)
        .where(_TASKS.c.id == bindparam("b_id"), _TASKS.c.status == TaskStatus.PENDING.value)
        .values(status_message=bindparam("b_msg")),
        [{"b_id": k, "b_msg": v} for k, v in reasons.items()],
    )
