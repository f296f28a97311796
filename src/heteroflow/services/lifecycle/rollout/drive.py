"""Drive a rollout (J1, J2) one step at a time.

``drive_group`` is one step, in one transaction that starts with the fence:
``UPDATE task_groups ... WHERE id AND rollout_holder = :me AND rollout_expires_at >= :now``
locks the group row (PostgreSQL; the write lock on SQLite) until commit, and refuses the
step (``RolloutLeaseLost``) once the lease lapsed — an instance paused past its lease
writes nothing, and the expiry scan cannot interleave with a step. The lease is renewed
when ``renew_s`` passed since the last renewal; after ``max_hold_s`` the rollout is given up.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.rollout import (
    RolloutPolicy,
    Step,
    abandon,
    lease_action,
    progress_from_json,
    step,
)
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import TaskGroup
from heteroflow.services.lifecycle.recovery import RUNNING
from heteroflow.services.lifecycle.rollout.reads import InFlightReader, no_reports, replicas
from heteroflow.services.lifecycle.rollout.writes import apply


class RolloutLeaseLost(Exception):
    """This instance does not hold the group's rollout lease (any more): nothing written."""


def _fence(s: Session, group_id: str, holder: str, now: datetime) -> TaskGroup:
    """Lock the group's row while ``holder`` holds its unexpired rollout lease (see the
    module); RolloutLeaseLost otherwise."""
    res = s.execute(
        update(TaskGroup)
        .where(
            TaskGroup.id == group_id,
            TaskGroup.rollout_holder == holder,
            TaskGroup.rollout_expires_at >= now,
        )
        .values(rollout_holder=TaskGroup.rollout_holder)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise RolloutLeaseLost(f"{holder} does not hold the rollout lease of {group_id}")
    g = s.get(TaskGroup, group_id, populate_existing=True)
    assert g is not None
    return g


def drive_group(
    s: Session,
    clock: Clock,
    group_id: str,
    holder: str,
    policy: RolloutPolicy,
    in_flight: InFlightReader = no_reports,
) -> Step:
    """One step of the rollout of ``group_id`` that ``holder`` holds (one transaction: the
    caller's session commits it)."""
    now = clock.now()
    g = _fence(s, group_id, holder, now)
    p = progress_from_json(g.rollout_spec)
    tasks, reps = replicas(s, g.id, g.rollout_started_at)
    action = lease_action(g.rollout_started_at, g.rollout_expires_at, now, policy)
    if g.deleted_at is not None:
        st = abandon(p, reps, "the service was deleted during the update", hard=True)
    elif g.desired != RUNNING:
        st = abandon(p, reps, "the service was stopped during the update", hard=True)
    elif action == "too_long":
        st = abandon(
            p, reps,
            f"the update held its lease for {policy.max_hold_s:g} s, the most it may; "
            "given up where it stood",
            hard=False,
        )
    else:
        if action == "renew":
            g.rollout_expires_at = now + timedelta(seconds=policy.lease_ttl_s)
        ids = [r.id for r in reps if r.status == TaskStatus.RUNNING and r.draining]
        st = step(p, reps, now, policy, in_flight(s, g.id, ids) if ids else {})
    apply(s, clock, g, st, {t.id: t for t in tasks})
    return st
