"""Scaling a service: by hand (I2, ``PUT .../scale``), its bounds and autoscaling policy
(``PUT .../scale-policy``), the autoscaler's round (I1) and the end of a scale-in.

**One write for every change of the replica count** (``apply_scale``; the API, the
autoscaler and a schedule window's ``scale`` action all go through it):

1. ``current_replicas`` (and ``world_size``: the replica count for split, the cards of
   all replicas otherwise) moves by compare-and-set — still the count the caller read,
   not deleted, meant to run, no rolling update holding the group — in the same
   transaction as the tasks below, so the count and the tasks never disagree. The
   update also holds the group row (PostgreSQL) or the database (SQLite) until commit,
   which orders it against a stop, a delete, a recovery rebuild or another scale.
2. Scale out: each missing rank below the new count gets a new ``pending`` task with
   the intent of the group's current replica of the lowest rank (``services.replicas``:
   same image, engine, arguments, environment, ports from the pool...), in the group's
   tenant — so a member who sees only their tenant's tasks manages the new ones too.
   The scheduler places them.
3. Scale in: the current tasks of the highest ranks leave; rank 0 never does (the
   count is at least 1). A leaving task stops being current at once (``replaced_by`` =
   ``"scaled-in"``): the group's status, its reads, the recovery loop and a start no
   longer count it. A running one is marked draining (M11: the gateways send it no new
   request) and stops later (``finish_scale_ins``); one that is not serving yet
   (pending, starting...) or asleep is stopped now.
4. One ``group.scaled`` event with the numbers, who, and the tasks added or leaving.

**The end of a scale-in** (``finish_scale_ins``, the leader every
``scale_drain_interval_s``): a leaving replica is stopped once every gateway that
reported within ``gateway_load_stale_s`` and routes to it says it drains and has nothing
in flight on it (``LoadView.drained``: a gateway whose snapshot does not yet mark it
draining may still send it requests, so it keeps it), or once ``scale_drain_timeout_s``
passed since it was marked. With no gateway reporting, nothing can be in flight.

**The autoscaler** (``autoscale_group``, the leader every ``autoscale_interval_s``, one
fenced transaction per group): ``core.autoscale`` decides from the gateways' load and
the group's replicas; a decision that changes the count is applied at once (the whole
difference) with ``apply_scale``. Every decision is a ``group.autoscale`` event with the
metric, the target, the formula, ``current → desired`` and why it was clamped (bounds,
or the tenant's quota: "quota-clamped", naming it) or held;
a decision equal to the last one written (same counts and the same kind of clamp or
hold, or the same reason to skip) is not written again, so a steady service does not
fill its timeline every 30 s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from heteroflow.core.autoscale import (
    MAX_REPLICAS,
    Decision,
    LoadView,
    Replica,
    ScalePolicy,
    SkipReason,
    decide,
    group_metric,
    scalable_problem,
    skip_reason,
    target_problem,
)
from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, ValidationFailed
from heteroflow.core.events import EventKind
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.schemas.task_groups import ScalePolicyIn, TaskGroupRead
from heteroflow.services.identity.access import visible_group
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle import draining
from heteroflow.services.lifecycle.recovery import RUNNING
from heteroflow.services.lifecycle.replicas import new_replica, rank_name
from heteroflow.services.lifecycle.task_groups import (  # the same reads and the one stop door
    _current,
    _fresh,
    ask_stop,
)
from heteroflow.services.lifecycle.transitions import refresh_group_status
from heteroflow.services.tenancy import quotas

log = logging.getLogger(__name__)

# ``tasks.replaced_by`` of a replica a scale-in took away (no task replaced it)
SCALED_IN = "scaled-in"
_ASLEEP = frozenset({TaskStatus.SLEEPING.value, TaskStatus.WAKING.value})
# a leaving task in one of these still has something to stop
_LEAVING_LIVE = frozenset(
    {
        TaskStatus.PENDING, TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING,
        TaskStatus.SLEEPING, TaskStatus.WAKING,
    }
)


@dataclass
class ScaleResult:
    group_id: str
    before: int
    after: int
    added: list[str] = field(default_factory=list)  # new task ids
    draining: list[str] = field(default_factory=list)  # running: stop once drained
    stopped: list[str] = field(default_factory=list)  # not serving yet: stopped now


# ---- the one write ---------------------------------------------------------------------


def apply_scale(
    s: Session, clock: Clock, g: TaskGroup, replicas: int, *, by: str, why: str = ""
) -> ScaleResult:
    """Set ``g``'s replica count to ``replicas`` and its tasks with it (see the module
    docstring). ``Conflict`` when the group changed since it was read (stopped, deleted,
    a rolling update began, another scale) or has no replica to copy. The caller checks
    who may and whether the count is within bounds."""
    before, gid = g.current_replicas, g.id
    current = _current(s, gid)
    if not current:
        raise Conflict(f"service {gid} has no current replica to scale from; start it")
    template = min(current, key=lambda t: (t.generation != g.current_generation, t.rank))
    world_size = replicas if g.parallelism == "split" else replicas * max(
        1, template.gpu_required
    )
    now = clock.now()
    moved = s.execute(
        update(TaskGroup)
        .where(
            TaskGroup.id == gid,
            TaskGroup.current_replicas == before,
            TaskGroup.deleted_at.is_(None),
            TaskGroup.desired == RUNNING,
            TaskGroup.rollout_holder == "",
        )
        .values(current_replicas=replicas, world_size=world_size, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(
            f"service {gid} changed while it was being scaled (stopped, deleted, an update "
            "began, or another scale); read it again and retry"
        )
    out = ScaleResult(gid, before, replicas)
    said = f"scaled from {before} to {replicas} replica(s) {by}" + (f" ({why})" if why else "")
    for t in sorted((t for t in current if t.rank >= replicas), key=lambda t: -t.rank):
        _leave(s, clock, t, said, out)
    have = {t.rank for t in current}
    for rank in range(replicas):
        if rank in have:
            continue
        new = new_replica(
            template,
            rank=rank,
            name=rank_name(template, g.name, rank),
            message=f"new replica (rank {rank}): {said}; waiting for the scheduler",
            health_check=g.health_check,
            now=now,
        )
        s.add(new)
        out.added.append(new.id)
    s.flush()
    s.expire(g)  # its count moved behind the ORM's back
    parts = [said]
    if out.added:
        parts.append("added " + ", ".join(out.added))
    if out.draining:
        parts.append(
            "draining (they stop once no gateway has a request in flight on them): "
            + ", ".join(out.draining)
        )
    if out.stopped:
        parts.append("stopped (not serving yet): " + ", ".join(out.stopped))
    s.add(
        Event(
            group_id=gid, task_id=None, kind=EventKind.SCALED.value, from_status=str(before),
            to_status=str(replicas), message="; ".join(parts), created_at=now,
        )
    )
    refresh_group_status(s, clock, gid, said)
    log.info("service %s: %s", gid, "; ".join(parts))
    return out


def _leave(s: Session, clock: Clock, t: Task, said: str, out: ScaleResult) -> None:
    """``t`` stops being current; a running one drains, any other stops now."""
    res = s.execute(
        update(Task)
        .where(Task.id == t.id, Task.replaced_by == "")
        .values(replaced_by=SCALED_IN, updated_at=clock.now())
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return  # replaced meanwhile (cannot happen under the group lock; harmless)
    s.expire(t)
    if TaskStatus(t.status) == TaskStatus.RUNNING:
        if not t.draining:
            draining.mark(s, clock, t, True, f"({said}; rank {t.rank} leaves)")
        out.draining.append(t.id)
    else:
        ask_stop(s, clock, t, f"{said}; rank {t.rank} leaves")
        out.stopped.append(t.id)


# ---- by hand: the API ----------------------------------------------------------------


def _not_now(s: Session, g: TaskGroup, what: str) -> None:
    """409 when ``g``'s replica count may not change now, saying why."""
    if g.desired != RUNNING:
        raise Conflict(f"service {g.id} is stopped: start it before {what}")
    if g.rollout_holder:
        raise Conflict(f"service {g.id} is being updated (a rolling update runs): {what} "
                       "waits until it ends")
    if g.window_action:
        raise Conflict(
            f"service {g.id} is outside its schedule window (its {g.window_action!r} action "
            f"is in effect): {what} waits until the window opens, or change the window"
        )
    statuses = {t.status for t in _current(s, g.id)}
    if statuses & _ASLEEP:
        raise Conflict(f"service {g.id} is asleep: wake it before {what}")


def _template(s: Session, g: TaskGroup) -> Task | None:
    """The replica a scale-out copies (``apply_scale``'s choice)."""
    current = _current(s, g.id)
    if not current:
        return None
    return min(current, key=lambda t: (t.generation != g.current_generation, t.rank))


def _check_quota(s: Session, g: TaskGroup, before: int, after: int) -> None:
    """N2: a scale-out's new replicas fit the tenant's quotas (409 naming the quota),
    checked under the tenant's lock; a scale-in is never refused."""
    if after <= before:
        return
    quotas.lock_tenant(s, g.tenant_id)
    template = _template(s, g)
    if template is None:
        return  # apply_scale refuses it with its own reason
    quotas.require(
        s, g.tenant_id, quotas.per_replica(template).times(after - before),
        f"scaling {g.name!r} from {before} to {after} replica(s)",
    )


def scale_group(
    s: Session, who: Principal, clock: Clock, group_id: str, replicas: int
) -> TaskGroupRead:
    """I2: ``replicas`` within [min_replicas, max_replicas] (400 naming ``replicas``);
    409 when stopped, asleep, updating or outside its schedule window; 404 for a group
    ``who`` cannot see. The same count again changes nothing."""
    g = visible_group(s, who, group_id)
    problem = scalable_problem(g.task_type, g.parallelism)
    if problem:
        raise ValidationFailed(f"replicas: {problem}", field="replicas")
    if not g.min_replicas <= replicas <= g.max_replicas:
        raise ValidationFailed(
            f"replicas {replicas} is outside [{g.min_replicas}, {g.max_replicas}] "
            "(min_replicas, max_replicas); change them with PUT .../scale-policy",
            field="replicas",
        )
    if replicas != g.current_replicas:
        _not_now(s, g, "scaling it")
        _check_quota(s, g, g.current_replicas, replicas)
        apply_scale(s, clock, g, replicas, by=f"by {who.username}")
    return _fresh(s, who, group_id)


def set_scale_policy(
    s: Session, who: Principal, clock: Clock, group_id: str, req: ScalePolicyIn
) -> TaskGroupRead:
    """The autoscaling policy and the replica bounds. A field left out keeps its stored
    value. When the current count falls outside new bounds it is moved to the nearest
    bound at once (409 when it may not change now: stopped, asleep...)."""
    g = visible_group(s, who, group_id)
    stored = dict(g.scale_policy or {})
    metric = req.metric or stored.get("metric")
    target = req.target if req.target is not None else stored.get("target")
    problem = scalable_problem(g.task_type, g.parallelism)
    if req.enabled:
        if problem:
            raise ValidationFailed(f"enabled: {problem}", field="enabled")
        if metric is None:
            raise ValidationFailed("enabling autoscaling needs a metric", field="metric")
        if target is None:
            raise ValidationFailed("enabling autoscaling needs a target", field="target")
    if metric is not None and target is not None:
        bad = target_problem(str(metric), float(target))
        if bad:
            raise ValidationFailed(f"target: {bad}", field="target")
    lo = g.min_replicas if req.min_replicas is None else req.min_replicas
    hi = g.max_replicas if req.max_replicas is None else req.max_replicas
    if problem and (lo, hi) != (g.min_replicas, g.max_replicas):
        name = "min_replicas" if lo != g.min_replicas else "max_replicas"
        raise ValidationFailed(f"{name}: {problem}", field=name)
    if lo > hi:
        name = "max_replicas" if req.max_replicas is not None else "min_replicas"
        raise ValidationFailed(f"max_replicas {hi} is below min_replicas {lo}", field=name)
    before = g.current_replicas
    fitted = min(max(before, lo), hi)
    if fitted != before:
        _not_now(s, g, f"bounds [{lo}, {hi}] that move it from {before} replica(s)")
        _check_quota(s, g, before, fitted)
    policy = (
        ScalePolicy(req.enabled, str(metric), float(target))
        if metric is not None and target is not None
        else None
    )
    g.min_replicas, g.max_replicas = lo, hi
    g.scale_policy = policy.to_json() if policy is not None else {}
    g.updated_at = clock.now()
    said = (policy.describe() if policy is not None else "autoscaling off") + (
        f"; replicas {lo}-{hi}"
    )
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=EventKind.CONFIG_CHANGED.value,
            message=f"scale policy changed by {who.username}: {said}", created_at=clock.now(),
        )
    )
    s.flush()
    if fitted != before:
        apply_scale(s, clock, g, fitted, by=f"by {who.username}", why=f"bounds now {lo}-{hi}")
    return _fresh(s, who, group_id)


def scale_as_platform(
    s: Session, clock: Clock, group_id: str, replicas: int, reason: str
) -> ScaleResult:
    """The platform sets a group's count (a schedule window's ``scale`` action and its
    restore; ``services.windows.Scaler``): within [min_replicas, max_replicas], else
    ``Conflict`` saying why; the same count changes nothing."""
    g = s.get(TaskGroup, group_id, populate_existing=True)
    if g is None or g.deleted_at is not None:
        raise Conflict(f"service {group_id} is gone")
    problem = scalable_problem(g.task_type, g.parallelism)
    if problem:
        raise Conflict(f"service {group_id}: {problem}")
    if not (1 <= replicas <= MAX_REPLICAS and g.min_replicas <= replicas <= g.max_replicas):
        raise Conflict(
            f"service {group_id}: {replicas} replica(s) is outside [{g.min_replicas}, "
            f"{g.max_replicas}]"
        )
    if replicas == g.current_replicas:
        return ScaleResult(group_id, replicas, replicas)
    return apply_scale(s, clock, g, replicas, by="by the platform", why=reason)


# ---- the end of a scale-in (leader) ----------------------------------------------------


def _drain_marks(s: Session, task_ids: Sequence[str]) -> dict[str, datetime]:
    """When each task was last marked draining."""
    out: dict[str, datetime] = {}
    if task_ids:
        for tid, at in s.execute(
            select(Event.task_id, Event.created_at)
            .where(Event.task_id.in_(list(task_ids)), Event.kind == EventKind.DRAIN.value)
            .order_by(Event.id)
        ):
            out[str(tid)] = at
    return out


def finish_scale_ins(
    s: Session, clock: Clock, load: LoadView, *, drain_timeout_s: float
) -> list[str]:
    """Stop the replicas a scale-in took away once drained (or past the drain timeout);
    the ids of the tasks asked to stop. Level-triggered: a replica whose draining mark
    was cleared by hand is marked again."""
    now = clock.now()
    rows = s.execute(
        select(Task, TaskGroup)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(
            Task.replaced_by == SCALED_IN,
            Task.status.in_([x.value for x in _LEAVING_LIVE]),
        )
        .order_by(Task.created_at)
    ).all()
    marks = _drain_marks(s, [t.id for t, _ in rows if t.status == TaskStatus.RUNNING.value])
    stopped: list[str] = []
    for t, g in rows:
        why = ""
        since = marks.get(t.id)
        if t.status != TaskStatus.RUNNING.value:
            why = f"scaled in; it was {t.status}, not serving"
        elif g.deleted_at is not None or g.desired != RUNNING:
            why = "scaled in; its service is stopped"
        elif not t.draining or since is None:
            draining.mark(s, clock, t, True, "again (it was scaled in)")
            continue
        elif load.drained(t.id):
            waited = (now - since).total_seconds()
            why = (
                f"scaled in; drained after {waited:.0f} s: no request in flight on it at "
                f"any of the {load.gateways} gateway(s) reporting"
            )
        elif (now - since).total_seconds() >= drain_timeout_s:
            why = (
                f"scaled in; drain timeout of {drain_timeout_s:g} s passed with "
                f"{load.in_flight(t.id)} request(s) still in flight on it"
            )
        else:
            continue
        try:
            ask_stop(s, clock, t, why)
        except Conflict:
            continue  # it kept moving; the next round looks again
        stopped.append(t.id)
    return stopped


# ---- the autoscaler (leader) ----------------------------------------------------------


@dataclass
class AutoscaleOutcome:
    group_id: str
    decision: Decision | None = None
    skipped: SkipReason | None = None
    scaled: ScaleResult | None = None


def autoscaled_groups(s: Session) -> list[str]:
    """Live inference services whose scale policy is enabled."""
    rows = s.execute(
        select(TaskGroup.id, TaskGroup.scale_policy)
        .where(TaskGroup.deleted_at.is_(None), TaskGroup.task_type == "inference")
        .order_by(TaskGroup.created_at)
    ).all()
    return [gid for gid, sp in rows if ScalePolicy.from_json(sp).enabled]


def _decision_event(
    s: Session, g: TaskGroup, now: datetime, to: str, message: str, *, always: bool
) -> bool:
    """One ``group.autoscale`` row, unless the last one said the same (counts or skip)."""
    frm = str(g.current_replicas)
    if not always:
        last = s.execute(
            select(Event.from_status, Event.to_status)
            .where(Event.group_id == g.id, Event.kind == EventKind.AUTOSCALE.value)
            .order_by(Event.id.desc())
            .limit(1)
        ).first()
        if last is not None and (last[0], last[1]) == (frm, to):
            return False
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=EventKind.AUTOSCALE.value, from_status=frm,
            to_status=to[:32], message=message, created_at=now,
        )
    )
    return True


def _quota_room(s: Session, g: TaskGroup) -> tuple[int, str] | None:
    """How many more replicas the tenant's quotas allow (None: no limit), read under
    the tenant's lock so a create or a scale of the same tenant cannot take it meanwhile."""
    _, quota = quotas.tenant_quota(s, g.tenant_id)
    template = _template(s, g)
    if not quota.limited or template is None:
        return None
    quotas.lock_tenant(s, g.tenant_id)
    return quotas.replica_headroom(s, g.tenant_id, quotas.per_replica(template))


def autoscale_group(
    s: Session,
    clock: Clock,
    group_id: str,
    load: LoadView,
    *,
    min_age_s: float,
    stale_s: float,
) -> AutoscaleOutcome | None:
    """One group's round: decide, write the decision, scale when it says so. None when
    the group is gone, not scalable, or its policy is off."""
    g = s.get(TaskGroup, group_id, populate_existing=True)
    if g is None or g.deleted_at is not None:
        return None
    policy = ScalePolicy.from_json(g.scale_policy)
    if not policy.enabled or scalable_problem(g.task_type, g.parallelism):
        return None
    now = clock.now()
    current = _current(s, g.id)
    skip = skip_reason(
        desired_state=g.desired,
        window_action=g.window_action,
        rollout_holder=g.rollout_holder,
        task_statuses=[t.status for t in current],
    )
    out = AutoscaleOutcome(g.id)
    if skip is not None:
        key, text = skip
        _decision_event(s, g, now, f"skip:{key}", f"autoscaler skipped: {text}", always=False)
        out.skipped = skip
        return out
    value = group_metric(policy.metric, load, [t.id for t in current], g.current_replicas)
    room = _quota_room(s, g)
    no_data = ""
    if load.gateways == 0:
        no_data = f"no gateway reported its load in the last {stale_s:g} s"
    elif value is None:
        no_data = f"no engine of this service reports its {policy.metric} figure"
    d = decide(
        policy=policy,
        current=g.current_replicas,
        lo=g.min_replicas,
        hi=g.max_replicas,
        value=value,
        replicas=[Replica(t.id, t.rank, t.running_at, t.created_at) for t in current],
        now=now,
        min_age_s=min_age_s,
        no_data=no_data,
        quota=room,
    )
    out.decision = d
    _decision_event(s, g, now, d.key, f"autoscaler: {d.describe()}", always=d.changes)
    g.autoscaled_at = now
    s.flush()
    if d.changes:
        assert d.value is not None
        out.scaled = apply_scale(
            s, clock, g, d.desired, by="by the autoscaler",
            why=f"{d.metric} {d.value:.2f} per replica, target {d.target:g}",
        )
    return out
