"""Gangs recover as one (issue 32 item 2, FEATURES G3, E1, E4): step 5 of a recovery round.

A ``pipeline`` group's stages find each other from the environment their placement gave
them (``core.gang``): one stage rebuilt alone on another node would wait for peers that
know another master address, and the stages left running would hang in a collective that
never completes. So a gang is judged as one, level-triggered, from its current stages:

1. A gang none of whose current stages failed is left alone.
2. A failed stage is judged by the single task's rules (``core.recovery.decide`` with the
   stage's own history: the E1 counter and its give-up, E4's lost hardware moving training
   and container work, a training stage's own failure being its result).
3. **Rebuild:** the gang's live stages are asked to stop ("gang restart"); once none is
   live any more (each stopped, failed or completed — a stage on a lost node is failed off
   it by step 1), every stage is replaced at once by a pending task of its rank with the
   failed stage's rebuild count, and the scheduler places the new gang all or nothing.
   One ``fault.rebuilt`` for the gang names the stage and the cause.
4. **Its own result, or given up:** the gang's live stages are stopped with the reason
   (``fault.gang_stopped`` once, or the give-up's ``fault.rebuild_gave_up``); nothing is
   rebuilt, and a start of the group runs it again.

A gang held by a rolling update is the update's (it replaces a gang as a unit).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.events import EventKind
from heteroflow.core.recovery import GiveUp, RecoveryPolicy, Skip, decide
from heteroflow.core.states import TERMINAL, TaskStatus
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.services.lifecycle import faults
from heteroflow.services.lifecycle.recovery import (
    RUNNING,
    RecoveryResult,
    _events_of,
    _give_up,
    _history,
    _lock_meant_to_run,
    attempt_of,
    cause_text,
    replace,
)
from heteroflow.services.lifecycle.transitions import refresh_group_status, transition

__all__ = ["recover_gangs"]

log = logging.getLogger(__name__)

# what a stage asked to stop goes to, from where it is
_STOP_TO = {
    TaskStatus.PENDING: TaskStatus.STOPPED,
    TaskStatus.SCHEDULED: TaskStatus.STOPPED,
    TaskStatus.SLEEPING: TaskStatus.STOPPED,
    TaskStatus.STARTING: TaskStatus.STOPPING,
    TaskStatus.RUNNING: TaskStatus.STOPPING,
    TaskStatus.WAKING: TaskStatus.STOPPING,
}


def recover_gangs(
    s: Session, clock: Clock, policy: RecoveryPolicy, out: RecoveryResult
) -> None:
    for g, stages in _gangs_with_a_failed_stage(s).items():
        _recover(s, clock, policy, out, g, stages)


def _gangs_with_a_failed_stage(s: Session) -> dict[TaskGroup, list[Task]]:
    failed_stage = exists().where(
        Task.group_id == TaskGroup.id,
        Task.replaced_by == "",
        Task.status == TaskStatus.FAILED.value,
    )
    groups = s.scalars(
        select(TaskGroup).where(
            TaskGroup.parallelism == "pipeline",
            TaskGroup.deleted_at.is_(None),
            TaskGroup.desired == RUNNING,
            TaskGroup.rollout_holder == "",
            failed_stage,
        ).order_by(TaskGroup.created_at)
    ).all()
    out: dict[TaskGroup, list[Task]] = {}
    if not groups:
        return out
    stages: dict[str, list[Task]] = defaultdict(list)
    for t in s.scalars(
        select(Task)
        .where(Task.group_id.in_([g.id for g in groups]), Task.replaced_by == "")
        .order_by(Task.rank, Task.created_at)
        .execution_options(populate_existing=True)
    ):
        stages[t.group_id].append(t)
    for g in groups:
        out[g] = stages[g.id]
    return out


def _recover(
    s: Session, clock: Clock, policy: RecoveryPolicy, out: RecoveryResult,
    g: TaskGroup, stages: list[Task],
) -> None:
    failed = [t for t in stages if t.status == TaskStatus.FAILED.value]
    first = min(failed, key=lambda t: (t.updated_at, t.rank))
    if _already_said(s, first.id):
        return  # given up on, or stopped as its own result: the owner's start runs it again
    events = _events_of(s, [first.id])
    attempt = attempt_of(first, events[first.id])
    history = _history(s, attempt, g.id, 1)
    # the single task's rules for the stage: "single", not "pipeline" (which skips)
    d = decide(history, [], policy, task_type=first.task_type, parallelism="single")
    cause = cause_text(first, attempt.fault)
    stage = f"stage {first.rank} ({first.name}, {first.id})"
    live = [t for t in stages if TaskStatus(t.status) not in TERMINAL]
    if isinstance(d, Skip | GiveUp):
        reason = (
            f"gang stopped: {stage} failed ({cause}); {d.reason}" if isinstance(d, Skip)
            else f"gang stopped: recovery gave up on {stage}"
        )
        _stop(s, clock, live, reason)
        if isinstance(d, GiveUp):
            _give_up(s, clock, first, g, d, cause)
            out.gave_up.append(first.id)
        else:
            faults.record(
                s, clock, group_id=g.id, task_id=first.id, node_id=first.node_id,
                kind=EventKind.GANG_STOPPED,
                message=f"{reason}; start the group to run the gang again",
            )
        refresh_group_status(s, clock, g.id, reason)
        return
    if live:  # the gang restarts as one: its other stages stop first
        if _stop(s, clock, live, f"gang restart: {stage} failed ({cause})"):
            refresh_group_status(s, clock, g.id, f"restarting the gang: {stage} failed")
        return
    if not _lock_meant_to_run(s, g.id, clock.now()):
        return  # stopped or deleted since the read: its owner's word wins
    new_ids: list[str] = []
    for t in stages:
        new = replace(
            s, clock, t, TaskStatus(t.status), count=d.count, health_check=dict(g.health_check),
            message=f"gang rebuilt from {t.id} (rebuild {d.count} of at most "
            f"{policy.max_rebuilds}); waiting for the scheduler to place the gang",
        )
        if new is not None:
            new_ids.append(new.id)
    if not new_ids:
        return
    text = (
        f"gang rebuilt as one ({len(new_ids)} stage(s)): {stage} failed; rebuild "
        f"{d.count} of at most {policy.max_rebuilds} in a row; cause: {cause}"
    )
    faults.record(
        s, clock, group_id=g.id, task_id=new_ids[0], node_id=first.node_id,
        kind=EventKind.REBUILT, message=text,
    )
    log.info("group %s: %s", g.id, text)
    refresh_group_status(s, clock, g.id, f"rebuilding the gang: {stage} failed")
    out.rebuilt.extend(new_ids)


def _already_said(s: Session, task_id: str) -> bool:
    kinds = (EventKind.REBUILD_GAVE_UP.value, EventKind.GANG_STOPPED.value)
    return bool(s.scalar(
        select(exists().where(Event.task_id == task_id, Event.kind.in_(kinds)))
    ))


def _stop(s: Session, clock: Clock, stages: list[Task], reason: str) -> bool:
    """Ask each live stage to stop (a stopping one is left as it is); whether any moved."""
    moved = False
    for t in stages:
        status = TaskStatus(t.status)
        to = _STOP_TO.get(status)
        if to is not None:
            moved |= transition(s, clock, t.id, status, to, reason)
    return moved
