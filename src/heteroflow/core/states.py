"""Lifecycles as transition tables: the one place that says which state change is legal.

Task (one container / engine process)::

    pending -> scheduled -> starting -> running -> stopping -> stopped
                   |            |          |
                   +------------+----------+--> failed (reason recorded)

``scheduled`` is the user-facing "scheduling" (placed, waiting for its agent);
``starting`` is claimed by the agent, engine launched, first health check not yet passed.
A task is routable only in ``running``. Sleeping / waking / draining arrive with the
sleep and rolling-update work and will extend these tables.

File request (C7)::

    pending -> running -> done | failed      (pending | running -> failed: expired)

Every state is a ``WireEnum``: its value is what the database and the wire carry, so
code compares members, never spelled-out strings.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class WireEnum(StrEnum):
    """A ``StrEnum`` whose repr is its wire value, so a validation error reads
    ``Input should be 'done' or 'failed'`` exactly as it did with string literals."""

    def __repr__(self) -> str:
        return repr(self.value)


class TaskStatus(WireEnum):
    PENDING = "pending"
    SCHEDULED = "scheduled"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    COMPLETED = "completed"


class GroupStatus(WireEnum):
    PENDING = "pending"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"
    COMPLETED = "completed"


T = TaskStatus

TASK_TRANSITIONS: dict[TaskStatus, frozenset[TaskStatus]] = {
    T.PENDING: frozenset({T.SCHEDULED, T.STOPPED}),
    T.SCHEDULED: frozenset({T.STARTING, T.PENDING, T.STOPPED, T.FAILED}),
    # back to the queue: a pool port found taken on the node at launch (P2)
    T.STARTING: frozenset({T.RUNNING, T.FAILED, T.STOPPING, T.STOPPED, T.COMPLETED, T.PENDING}),
    T.RUNNING: frozenset({T.FAILED, T.STOPPING, T.STOPPED, T.COMPLETED}),
    # back to the queue: a preempted task once its agent stopped it (B4)
    T.STOPPING: frozenset({T.STOPPED, T.FAILED, T.PENDING}),
    T.STOPPED: frozenset(),
    T.FAILED: frozenset({T.STOPPED}),
    T.COMPLETED: frozenset({T.STOPPED}),
}

# Tasks that hold a placement (node, cards, host port) and so count against capacity.
HOLDS_RESOURCES = frozenset({T.SCHEDULED, T.STARTING, T.RUNNING, T.STOPPING})
# Tasks an agent should be running (or starting) on its node.
AGENT_OWNED = frozenset({T.STARTING, T.RUNNING})
TERMINAL = frozenset({T.STOPPED, T.FAILED, T.COMPLETED})

# What an agent may report a task as (``TaskReport.status``): the report's target state.
# ``starting`` is a note on a task still starting (a launch retried, and why); ``pending``
# gives a task back to the scheduler because host ports the pool chose are taken (P2).
ReportTarget = Literal[T.RUNNING, T.FAILED, T.STOPPED, T.COMPLETED, T.STARTING, T.PENDING]


class FileRequestStatus(WireEnum):
    """A file request's lifecycle (services/files.py moves it by compare-and-set)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


# What the agent may finish a file request with (``FileRequestDone.status``).
FileOutcome = Literal[FileRequestStatus.DONE, FileRequestStatus.FAILED]


def can_transition(src: TaskStatus, dst: TaskStatus) -> bool:
    return dst in TASK_TRANSITIONS[src]


def group_status(task_statuses: list[TaskStatus], *, deleting: bool = False) -> GroupStatus:
    """The group's status, derived from its tasks (a pure summary, never set by hand)."""
    s = set(task_statuses)
    if not s:
        return GroupStatus.STOPPED if deleting else GroupStatus.PENDING
    if deleting or T.STOPPING in s:
        return GroupStatus.STOPPING if s - TERMINAL else GroupStatus.STOPPED
    if T.FAILED in s:
        return GroupStatus.FAILED
    if s == {T.RUNNING}:
        return GroupStatus.RUNNING
    if s <= {T.STOPPED}:
        return GroupStatus.STOPPED
    if s <= {T.COMPLETED, T.STOPPED}:
        return GroupStatus.COMPLETED
    if s & {T.SCHEDULED, T.STARTING, T.RUNNING}:
        return GroupStatus.SCHEDULING
    return GroupStatus.PENDING
