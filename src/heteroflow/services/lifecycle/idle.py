"""Idle sleep and wake on request (F4, F6): the state side.

**Activity.** Gateways report, per flush, each group's last routed request
(``record_activity``): one ``UPDATE`` per group that only moves ``last_request_at``
forward, so batches from several gateways (or a late retry) never move it back.

**The idle timer** (``idle_groups`` / ``sleep_if_idle``; the leader's loop is
``controllers/idle.py``). A group is idle when it

- is a live inference service with ``idle_timeout_minutes`` > 0 (0 = never),
- is meant to run (``desired`` = "running": a user stop is not a sleep),
- has current tasks and every one is ``running`` (a service that is starting, waking,
  partly asleep or failing is left alone: its timer starts when it runs; a pipeline
  gang's stages likewise: it sleeps whole or not at all), and
- has had no activity for the timeout, where its last activity is the later of its last
  routed request and the moment its newest task last became running (``running_at``) —
  so a service that never got a request still gets its full timeout after it started or
  woke. Of a pipeline gang only rank 0, the stage that serves the API
  (``core.gang.serves_api``), counts: the gateway routes to it alone, and a headless
  stage neither keeps the gang awake nor puts it to sleep by itself.

It is then put to sleep through ``services.sleep.sleep_group`` with the reason
"idle for N min". The check is repeated inside the sleeping transaction, so activity
that arrived since the read wins.

**Wake on request.** ``wake_for_request`` runs ``services.sleep.wake_group`` for the
groups a gateway names and answers one ``WakeOutcome`` per task (the gateway holds the
request while the branch says the task is on its way up, and answers 503 with the
message otherwise). A group that is gone or was stopped by its owner answers one outcome
with branch "failed" and the reason, never an error for the whole batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.gang import serves_api
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Task, TaskGroup
from heteroflow.schemas.routing import WakeOutcome
from heteroflow.services.lifecycle import sleep

MINUTE_S = 60.0


@dataclass(frozen=True, slots=True)
class IdleGroup:
    group_id: str
    timeout_minutes: int
    last_active: datetime


def record_activity(s: Session, activity: Mapping[str, datetime]) -> int:
    """Move each group's ``last_request_at`` forward to the reported time (never back);
    returns how many groups moved. Unknown or deleted groups are ignored."""
    moved = 0
    for group_id, at in activity.items():
        at = _utc(at)
        res = s.execute(
            update(TaskGroup)
            .where(
                TaskGroup.id == group_id,
                TaskGroup.deleted_at.is_(None),
                or_(TaskGroup.last_request_at.is_(None), TaskGroup.last_request_at < at),
            )
            .values(last_request_at=at)
            .execution_options(synchronize_session=False)
        )
        moved += res.rowcount  # type: ignore[attr-defined]
    return moved


def idle_due(
    *,
    timeout_minutes: int,
    desired: str,
    statuses: Iterable[str],
    last_request_at: datetime | None,
    running_at: datetime | None,
    minute_s: float = MINUTE_S,
) -> datetime | None:
    """When a service becomes idle (F4), or None while the timer does not run for it.

    Pure: the rule of the module's docstring. ``statuses`` are its current tasks',
    ``running_at`` the latest moment one of them became running."""
    if timeout_minutes <= 0 or desired != "running":
        return None
    if set(statuses) != {TaskStatus.RUNNING.value}:
        return None  # starting, waking, partly asleep, failing, or no task at all
    marks = [_utc(t) for t in (last_request_at, running_at) if t is not None]
    if not marks:
        return None  # running without a running_at cannot happen; never guess
    return max(marks) + timedelta(seconds=timeout_minutes * minute_s)


def idle_groups(
    s: Session, now: datetime, *, minute_s: float = MINUTE_S, group_ids: Iterable[str] = ()
) -> list[IdleGroup]:
    """The groups to put to sleep at ``now`` (all, or only ``group_ids``)."""
    q = select(
        TaskGroup.id, TaskGroup.idle_timeout_minutes, TaskGroup.desired,
        TaskGroup.last_request_at, TaskGroup.parallelism,
    ).where(
        TaskGroup.deleted_at.is_(None),
        TaskGroup.idle_timeout_minutes > 0,
        TaskGroup.desired == "running",
        TaskGroup.task_type == "inference",
        TaskGroup.rollout_holder == "",  # an update in progress: its own driver decides
    )
    only = list(group_ids)
    if only:
        q = q.where(TaskGroup.id.in_(only))
    groups: dict[str, tuple[int, str, datetime | None]] = {}
    parallelism: dict[str, str] = {}
    for gid, minutes, desired, last, par in s.execute(q):
        groups[gid] = (minutes, desired, last)
        parallelism[gid] = par
    if not groups:
        return []
    statuses: dict[str, set[str]] = defaultdict(set)
    became_running: dict[str, datetime] = {}
    for gid, status, running_at, rank in s.execute(
        select(Task.group_id, Task.status, Task.running_at, Task.rank).where(
            Task.group_id.in_(list(groups)), Task.replaced_by == ""
        )
    ):
        statuses[gid].add(status)  # a gang idles only whole: every stage running
        # issue 32: only the stage that serves the API is judged busy (a headless
        # stage's restart is no activity); it is rank 0 of a gang
        if running_at is not None and serves_api(parallelism[gid], rank):
            ran = _utc(running_at)
            if gid not in became_running or became_running[gid] < ran:
                became_running[gid] = ran
    now = _utc(now)
    out: list[IdleGroup] = []
    for gid, (minutes, desired, last_request) in sorted(groups.items()):
        due = idle_due(
            timeout_minutes=minutes,
            desired=desired,
            statuses=statuses.get(gid, ()),
            last_request_at=last_request,
            running_at=became_running.get(gid),
            minute_s=minute_s,
        )
        if due is not None and now >= due:
            out.append(IdleGroup(gid, minutes, due - timedelta(seconds=minutes * minute_s)))
    return out


def sleep_if_idle(
    s: Session, clock: Clock, group_id: str, *, minute_s: float = MINUTE_S
) -> list[str]:
    """Put ``group_id`` to sleep when it is (still) idle; the task ids put to sleep."""
    found = idle_groups(s, clock.now(), minute_s=minute_s, group_ids=[group_id])
    if not found:
        return []
    return sleep.sleep_group(s, clock, group_id, f"idle for {found[0].timeout_minutes} min")


def wake_for_request(
    s: Session,
    clock: Clock,
    group_ids: Iterable[str],
    model: str = "",
    *,
    offline_after_s: float = sleep.DEFAULT_OFFLINE_AFTER_S,
) -> list[WakeOutcome]:
    """Wake each group for a gateway (F6); one outcome per task, "failed" per group that
    cannot be woken (gone, stopped by its owner, not a service)."""
    reason = f"by a request for model {model}" if model else "by a request"
    out: list[WakeOutcome] = []
    for gid in dict.fromkeys(group_ids):
        try:
            results = sleep.wake_group(
                s, clock, gid, reason, offline_after_s=offline_after_s
            )
        except (NotFound, Conflict) as exc:
            out.append(WakeOutcome(gid, "", "failed", str(exc)))
            continue
        out.extend(WakeOutcome(gid, r.task_id, r.branch, r.message) for r in results)
    return out


def _utc(t: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored as UTC)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
