"""The expiry scan (J4).

``scan`` fails rollouts whose lease lapsed — ``rolling_update_state`` failed, the reason in
``rolling_update_message``, the lease released, the group left serving as it is
(``core.rollout.abandon``) — and retires candidates no rollout owns any more. Every
instance runs it at start and every ``rollout_scan_interval_s``; it writes only by
compare-and-set on the lapsed lease, so two instances scanning at once are safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.rollout import (
    CANDIDATE,
    Progress,
    RolloutPolicy,
    Step,
    Strategy,
    abandon,
    orphans,
    progress_from_json,
)
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Task, TaskGroup
from heteroflow.services.lifecycle import draining
from heteroflow.services.lifecycle.recovery import RUNNING
from heteroflow.services.lifecycle.rollout.reads import last_drained, replica, replicas
from heteroflow.services.lifecycle.rollout.writes import apply
from heteroflow.services.lifecycle.task_groups import ask_stop

log = logging.getLogger(__name__)


_LIVE = [
    s.value for s in TaskStatus
    if s not in (TaskStatus.STOPPED, TaskStatus.FAILED, TaskStatus.COMPLETED, TaskStatus.STOPPING)
]


@dataclass
class ScanResult:
    failed: list[str] = field(default_factory=list)  # groups whose rollout was failed
    stopped: list[str] = field(default_factory=list)  # orphaned candidates stopped
    drained: list[str] = field(default_factory=list)  # ... or drained first


def abandon_expired(
    s: Session, clock: Clock, g: TaskGroup, policy: RolloutPolicy
) -> Step | None:
    """Fail ``g``'s rollout if its lease lapsed (compare-and-set on the lapsed lease);
    the step written, or None when the lease was not lapsed (any more)."""
    now = clock.now()
    holder, expired = g.rollout_holder, g.rollout_expires_at
    res = s.execute(
        update(TaskGroup)
        .where(
            TaskGroup.id == g.id,
            TaskGroup.rollout_holder == holder,
            or_(TaskGroup.rollout_expires_at < now, TaskGroup.rollout_expires_at.is_(None)),
        )
        .values(rollout_holder="", rollout_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1 or not holder:  # type: ignore[attr-defined]
        return None
    s.expire(g)
    when = f" at {expired.isoformat(timespec='seconds')}" if expired is not None else ""
    reason = (
        f"the server instance {holder} that ran the update stopped renewing its lease "
        f"(it expired{when}); resubmit the update"
    )
    tasks, reps = replicas(s, g.id)
    try:
        p = progress_from_json(g.rollout_spec)
    except (KeyError, ValueError):
        p = Progress(Strategy.ROLLING, g.current_generation, g.current_generation)
    hard = g.deleted_at is not None or g.desired != RUNNING
    st = abandon(p, reps, reason, hard=hard)
    apply(s, clock, g, st, {t.id: t for t in tasks})
    log.warning("group %s: rollout failed: %s", g.id, reason)
    return st


def scan(s: Session, clock: Clock, policy: RolloutPolicy) -> ScanResult:
    """Fail every rollout whose lease lapsed; retire candidates no rollout owns."""
    out = ScanResult()
    now = clock.now()
    expired = list(
        s.scalars(
            select(TaskGroup)
            .where(
                TaskGroup.rollout_holder != "",
                or_(TaskGroup.rollout_expires_at < now, TaskGroup.rollout_expires_at.is_(None)),
            )
            .order_by(TaskGroup.id)
        )
    )
    for g in expired:
        st = abandon_expired(s, clock, g, policy)
        if st is not None:
            out.failed.append(g.id)
            out.stopped.extend(st.stop)
            out.drained.extend(st.drain)
    # candidates first, then the rollouts that own them (a candidate is written with its
    # rollout's progress, so one seen here is in a progress read after)
    cands = list(
        s.scalars(
            select(Task)
            .where(Task.replaced_by == CANDIDATE, Task.status.in_(_LIVE))
            .execution_options(populate_existing=True)
        )
    )
    if not cands:
        return out
    owned: set[str] = set()
    for spec in s.scalars(
        select(TaskGroup.rollout_spec).where(
            TaskGroup.id.in_(sorted({t.group_id for t in cands})), TaskGroup.rollout_holder != ""
        )
    ):
        try:
            p = progress_from_json(spec)
        except (KeyError, ValueError):
            continue
        owned.update(p.candidates.values(), p.retiring)
    reps = [replica(t) for t in cands]
    since = last_drained(s, [t.id for t in cands if t.draining])
    stop, drain = orphans(reps, owned, since.get, now, policy)
    by_id = {t.id: t for t in cands}
    for tid in drain:
        draining.mark(s, clock, by_id[tid], True, "(a new replica of an update that ended)")
        out.drained.append(tid)
    for tid in stop:
        ask_stop(s, clock, by_id[tid], "a new replica of an update that ended; stopped")
        out.stopped.append(tid)
    return out
