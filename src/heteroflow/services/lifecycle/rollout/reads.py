"""What a rollout reads: the group's replicas as the machine sees them, its current
replicas, the groups an instance holds, and what the gateways say is in flight."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.events import EventKind
from heteroflow.core.gang import serves_api
from heteroflow.core.rollout import CANDIDATE, InFlight, Replica
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.services.tenancy.usage import read_load

# What the gateways say is in flight on some tasks: (session, group id, task ids) ->
# task id -> (count, as of). The default knows nothing: a draining replica then waits
# rollout_drain_timeout_s before it stops.
InFlightReader = Callable[[Session, str, Sequence[str]], InFlight]


def no_reports(s: Session, group_id: str, task_ids: Sequence[str]) -> InFlight:
    return {}


def gateway_reports(clock: Clock, stale_s: float) -> InFlightReader:
    """The drains' signal from the gateways' load reports (services/tenancy/usage.py): per task,
    the requests in flight summed over every gateway that reported within ``stale_s``,
    as of the oldest of those reports; a task some gateway still routes to (its snapshot
    does not say it drains yet) counts as busy. Nothing when no gateway reported."""

    def read(s: Session, group_id: str, task_ids: Sequence[str]) -> InFlight:
        view = read_load(s, clock.now(), stale_s)
        if view.as_of is None:
            return {}
        out: dict[str, tuple[int, datetime]] = {}
        for t in task_ids:
            n = view.in_flight(t)
            out[t] = (n if n or view.drained(t) else 1, view.as_of)
        return out

    return read


def replica(
    t: Task, unpullable: bool = False, busy: tuple[str, datetime] | None = None,
    prepull: tuple[str, str] = ("", ""), parallelism: str = "single",
) -> Replica:
    """A task row as the machine sees it (``busy``: what its agent last said it does before
    it serves, and since when — see ``_busy``)."""
    news_at = None
    if busy is not None:  # the agent's notes since write the status message alone (D5)
        news_at = max(busy[1], t.updated_at) if t.updated_at is not None else busy[1]
    return Replica(
        id=t.id,
        rank=t.rank,
        generation=t.generation,
        status=TaskStatus(t.status),
        replaced_by=t.replaced_by,
        draining=bool(t.draining),
        running_at=t.running_at,
        message=t.status_message or "",
        unpullable=unpullable,
        busy=busy[0] if busy is not None else "",
        news_at=news_at,
        prepull=prepull[0],
        prepull_message=prepull[1],
        serves=serves_api(parallelism, t.rank),
    )


def replicas(
    s: Session, group_id: str, since: datetime | None = None
) -> tuple[list[Task], list[Replica]]:
    """Every task of the group (read afresh), and each as a replica (with what its agent
    said of a recreate's pre-pull since ``since``, the update's start)."""
    tasks = list(
        s.scalars(
            select(Task)
            .where(Task.group_id == group_id)
            .order_by(Task.created_at, Task.id)
            .execution_options(populate_existing=True)
        )
    )
    failed = [t.id for t in tasks if t.replaced_by == CANDIDATE and t.status == TaskStatus.FAILED]
    unpullable = _unpullable(s, failed) if failed else set()
    starting = [
        t.id for t in tasks if t.replaced_by == CANDIDATE and t.status == TaskStatus.STARTING
    ]
    busy = _busy(s, starting) if starting else {}
    pulls = _prepulls(s, group_id, since) if since is not None else {}
    par = s.scalar(select(TaskGroup.parallelism).where(TaskGroup.id == group_id)) or "single"
    return tasks, [
        replica(t, t.id in unpullable, busy.get(t.id), pulls.get(t.id, ("", "")), par)
        for t in tasks
    ]


def _prepulls(s: Session, group_id: str, since: datetime) -> dict[str, tuple[str, str]]:
    """Per task, the newest word of its agent on a recreate's pre-pull since ``since``
    (``rollout.prepull`` events: the outcome in ``to_status``, the words in the message)."""
    rows = s.execute(
        select(Event.task_id, Event.to_status, Event.message)
        .where(
            Event.group_id == group_id,
            Event.kind == EventKind.ROLLOUT_PREPULL.value,
            Event.created_at >= since,
        )
        .order_by(Event.created_at, Event.id)
    )
    return {str(tid): (str(outcome), str(msg)) for tid, outcome, msg in rows}


# The agent's notes that open what a starting task does before it serves (D5, H7): its
# image pull began or ended, its load window opened. Every later note (how far) writes
# the task's status message alone, so its ``updated_at`` is the agent's latest word.
_BUSY = {EventKind.LOADING.value: "loading", EventKind.IMAGE_PULL.value: "pulling"}


def _busy(s: Session, task_ids: list[str]) -> dict[str, tuple[str, datetime]]:
    """Per starting candidate that has such a note: what its newest one says it does
    ("loading" or "pulling") and when it was written."""
    rows = s.execute(
        select(Event.task_id, Event.kind, Event.created_at)
        .where(Event.task_id.in_(task_ids), Event.kind.in_(list(_BUSY)))
        .order_by(Event.created_at, Event.id)
    )
    out: dict[str, tuple[str, datetime]] = {}
    for tid, kind, at in rows:
        out[str(tid)] = (_BUSY[str(kind)], at)
    return out


def _unpullable(s: Session, task_ids: list[str]) -> set[str]:
    """The failed candidates whose image cannot be pulled (H7: their fault event)."""
    rows = s.scalars(
        select(Event.task_id).where(
            Event.task_id.in_(task_ids), Event.kind == EventKind.IMAGE_UNAVAILABLE.value
        )
    )
    return {str(t) for t in rows}


def current_tasks(s: Session, group_id: str) -> list[Task]:
    """The group's current replicas (read afresh), by rank."""
    return list(
        s.scalars(
            select(Task)
            .where(Task.group_id == group_id, Task.replaced_by == "")
            .order_by(Task.rank, Task.created_at)
            .execution_options(populate_existing=True)
        )
    )


def held_by(s: Session, holder: str) -> list[str]:
    """The groups whose rollout ``holder`` holds."""
    return list(
        s.scalars(
            select(TaskGroup.id).where(TaskGroup.rollout_holder == holder).order_by(TaskGroup.id)
        )
    )


def last_drained(s: Session, task_ids: list[str]) -> dict[str, datetime]:
    """When each task was last marked draining (its newest drain event)."""
    if not task_ids:
        return {}
    rows = s.execute(
        select(Event.task_id, func.max(Event.created_at))
        .where(Event.task_id.in_(task_ids), Event.kind == EventKind.DRAIN.value)
        .group_by(Event.task_id)
    )
    return {str(t): at for t, at in rows}
