"""Lifecycles as transition tables: the one place that says which state change is legal.

Task (one container / engine process)::

    pending -> scheduled -> starting -> running -> stopping -> stopped
                   |            |          |  ^
                   |            |          v  |
                   |            |      sleeping -> waking
                   +------------+----------+-----------+--> failed (reason recorded)

``scheduled`` is the user-facing "scheduling" (placed, waiting for its agent);
``starting`` is claimed by the agent, engine launched, first health check not yet passed.
``sleeping`` (F1): its engine is stopped and its memory released, but it keeps its node,
its cards' commitment and its inference-container slot, and its container (Docker) is
kept for the wake; ``waking`` (F2): the engine is starting again on the same node. A
task is routable only in ``running`` (a sleeping service is listed, and a request for it
wakes it). A replica leaving a rolling update stays ``running`` with ``draining`` set
(M11): no new requests, in-flight ones finish. ``starting``, ``running`` and
``waking`` go back to ``scheduled`` when the engine stopped with its own agent (a
restart of the agent or of ``heteroflow up``): it keeps its placement, and the agent
claims and starts it again when it is back — no failure, no rebuild.

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
    SLEEPING = "sleeping"
    WAKING = "waking"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    COMPLETED = "completed"


class GroupStatus(WireEnum):
    PENDING = "pending"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    SLEEPING = "sleeping"
    WAKING = "waking"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"
    COMPLETED = "completed"


T = TaskStatus

TASK_TRANSITIONS: dict[TaskStatus, frozenset[TaskStatus]] = {
    T.PENDING: frozenset({T.SCHEDULED, T.STOPPED}),
    T.SCHEDULED: frozenset({T.STARTING, T.PENDING, T.STOPPED, T.FAILED}),
    # back to the queue: a pool port found taken on the node at launch (P2); back to
    # scheduled (starting, running, waking): its engine stopped with its own agent, which
    # starts it again on the same placement when it is back (RESTARTED_WITH_AGENT)
    T.STARTING: frozenset(
        {T.RUNNING, T.FAILED, T.STOPPING, T.STOPPED, T.COMPLETED, T.PENDING, T.SCHEDULED}
    ),
    T.RUNNING: frozenset(
        {T.FAILED, T.STOPPING, T.STOPPED, T.COMPLETED, T.SLEEPING, T.SCHEDULED}
    ),
    # F1/F2: asleep on its node; woken there (or failed: node gone, container gone)
    T.SLEEPING: frozenset({T.WAKING, T.STOPPING, T.STOPPED, T.FAILED}),
    T.WAKING: frozenset(
        {T.RUNNING, T.SLEEPING, T.STOPPING, T.STOPPED, T.FAILED, T.SCHEDULED}
    ),
    # back to the queue: a preempted task once its agent stopped it (B4)
    T.STOPPING: frozenset({T.STOPPED, T.FAILED, T.PENDING}),
    T.STOPPED: frozenset(),
    T.FAILED: frozenset({T.STOPPED}),
    T.COMPLETED: frozenset({T.STOPPED}),
}

# Tasks that hold a placement (node, cards, host port) and so count against capacity: a
# sleeping one keeps its commitment and slot (F1), though training may borrow (F5).
HOLDS_RESOURCES = frozenset(
    {T.SCHEDULED, T.STARTING, T.RUNNING, T.SLEEPING, T.WAKING, T.STOPPING}
)
# Tasks an agent should be running (or starting) on its node.
AGENT_OWNED = frozenset({T.STARTING, T.RUNNING, T.WAKING})
# Tasks an agent gives back to ``scheduled`` when their engine stopped with the agent
# itself (its shutdown, or found gone when it came back): not the task's failure, so
# no fault and no rebuild — the same placement is claimed and started again.
RESTARTED_WITH_AGENT = AGENT_OWNED
# Tasks whose engine is (or should be) up: what the run timeout and the idle timer watch.
ENGINE_UP = frozenset({T.STARTING, T.RUNNING, T.WAKING})
TERMINAL = frozenset({T.STOPPED, T.FAILED, T.COMPLETED})

# What an agent may report a task as (``TaskReport.status``): the report's target state.
# ``starting`` is a note on a task still starting (a launch retried, and why; D5: how its
# load goes), ``waking`` a note on a task still waking (D5: how its load goes),
# ``sleeping`` a note on a sleeping task (F1: how its engine sleeps); ``pending``
# gives a task back to the scheduler because host ports the pool chose are taken (P2);
# ``scheduled`` gives it back to its own node because the engine stopped with the agent.
ReportTarget = Literal[
    T.RUNNING, T.FAILED, T.STOPPED, T.COMPLETED, T.STARTING, T.WAKING, T.SLEEPING, T.PENDING,
    T.SCHEDULED,
]
# The report targets that are notes: the task keeps its state, its status message changes.
NOTE_TARGETS = frozenset({T.STARTING, T.WAKING, T.SLEEPING})


class FileRequestStatus(WireEnum):
    """A file request's lifecycle (services/agents/files.py moves it by compare-and-set)."""

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
    if T.SLEEPING in s and s <= {T.SLEEPING, T.STOPPED}:
        return GroupStatus.SLEEPING
    if T.WAKING in s and s <= {T.WAKING, T.SLEEPING, T.RUNNING, T.STOPPED}:
        return GroupStatus.WAKING
    if T.RUNNING in s and s <= {T.RUNNING, T.SLEEPING}:
        return GroupStatus.RUNNING  # a replica asleep, the others serve
    if s <= {T.STOPPED}:
        return GroupStatus.STOPPED
    if s <= {T.COMPLETED, T.STOPPED}:
        return GroupStatus.COMPLETED
    if s & {T.SCHEDULED, T.STARTING, T.RUNNING}:
        return GroupStatus.SCHEDULING
    return GroupStatus.PENDING
