"""Rolling update and recreate (J1-J4): start one, drive it a step at a time, and fail
the ones whose holder died. The decisions are ``core/rollout.py``'s; this module reads
the facts and writes what it says.

**Start (J3).** ``start_update`` checks the new generation's task with the create's own
rule (``services.planning.check_task``: an update that cannot run — say a custom
command where every node runs the process runtime — is refused at the request, never a
200 that waits for ever; errors name the field), then takes the rollout's execution
lease and bumps the generation in one compare-and-set::

    UPDATE task_groups SET current_generation = g + 1, rollout_holder = :me,
           rollout_expires_at = :now + ttl, rollout_started_at = :now, rollout_spec = ...
     WHERE id = :id AND current_generation = g
       AND (rollout_holder = '' OR rollout_expires_at < :now)

so of two updates submitted at once exactly one starts (the other: 409). ``:me`` is the
server instance that answered the PUT; it drives the rollout (``controllers/rollout.py``).
``current_generation`` counts updates: the number of the newest generation ever started
(a failed update's number is not reused), while each task carries its own generation —
after a rollback the replicas serve the generation they had.

**Quotas (N2).** An update changes no card, memory or replica count, so only a rolling
update's surge is checked: its batch of candidates runs beside the replicas it replaces
and counts against the tenant's quotas meanwhile (409 naming the quota; recreate has no
surge).

**Drive.** ``drive_group`` is one step, in one transaction that starts with the fence:
``UPDATE task_groups ... WHERE id AND rollout_holder = :me AND rollout_expires_at >= :now``
locks the group row (PostgreSQL; the write lock on SQLite) until commit, and refuses the
step (``RolloutLeaseLost``) once the lease lapsed — an instance paused past its lease
writes nothing, and the expiry scan cannot interleave with a step. The lease is renewed
when ``renew_s`` passed since the last renewal; after ``max_hold_s`` the rollout is given up.

**Recovery.** While a rollout holds its lease it owns the group's replicas: the recovery
loop leaves the group alone (services/recovery.py), so a failing new replica is the
rollout's to retry, not a rebuild; afterwards the loop takes over again.

**Expiry scan (J4).** ``scan`` fails rollouts whose lease lapsed — ``rolling_update_state``
failed, the reason in ``rolling_update_message``, the lease released, the group left
serving as it is (``core.rollout.abandon``) — and retires candidates no rollout owns any
more. Every instance runs it at start and every ``rollout_scan_interval_s``; it writes
only by compare-and-set on the lapsed lease, so two instances scanning at once are safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import DEFAULT_ENV_ALLOW
from heteroflow.core.engines import resolve_engine
from heteroflow.core.errors import Conflict, ValidationFailed
from heteroflow.core.events import EventKind
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.rollout import (
    CANDIDATE,
    InFlight,
    Progress,
    Promote,
    Replica,
    RolloutPolicy,
    RolloutState,
    Step,
    Strategy,
    abandon,
    lease_action,
    orphans,
    progress_from_json,
    progress_to_json,
    step,
)
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.schemas.task_groups import TaskGroupRead, TaskGroupUpdate, TaskSpec
from heteroflow.services import draining, quotas
from heteroflow.services.auth import Principal
from heteroflow.services.fleet import read_fleet
from heteroflow.services.planning import check_task
from heteroflow.services.recovery import RUNNING
from heteroflow.services.replicas import new_replica
from heteroflow.services.task_groups import ask_stop, get_group
from heteroflow.services.transitions import refresh_group_status
from heteroflow.services.usage import read_load

log = logging.getLogger(__name__)

# the task intent an update may change (everything else is inherited)
CHANGEABLE = ("image", "engine_args", "env", "command", "kv_offload_gb")
_ASLEEP = frozenset({TaskStatus.SLEEPING, TaskStatus.WAKING})
_LIVE = [
    s.value for s in TaskStatus
    if s not in (TaskStatus.STOPPED, TaskStatus.FAILED, TaskStatus.COMPLETED, TaskStatus.STOPPING)
]


class RolloutLeaseLost(Exception):
    """This instance does not hold the group's rollout lease (any more): nothing written."""


# What the gateways say is in flight on some tasks: (session, group id, task ids) ->
# task id -> (count, as of). The default knows nothing: a draining replica then waits
# rollout_drain_timeout_s before it stops.
InFlightReader = Callable[[Session, str, Sequence[str]], InFlight]


def no_reports(s: Session, group_id: str, task_ids: Sequence[str]) -> InFlight:
    return {}


def gateway_reports(clock: Clock, stale_s: float) -> InFlightReader:
    """The drains' signal from the gateways' load reports (services/usage.py): per task,
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


# ---- start (J3) ------------------------------------------------------------------------


def _changes(req: TaskGroupUpdate) -> dict[str, Any]:
    return {k: getattr(req, k) for k in CHANGEABLE if getattr(req, k) is not None}


def _check(
    s: Session,
    clock: Clock,
    g: TaskGroup,
    current: list[Task],
    req: TaskGroupUpdate,
    env_allow: Sequence[str],
    offline_after_s: float,
) -> dict[str, Any]:
    """The update's changes, its new generation checked as a create checks its task (400
    naming the field): what only an update can get wrong here, then ``check_task``."""
    changes = _changes(req)
    if not changes:
        raise ValidationFailed(
            "nothing to update: give image (and / or engine_args, env, command, "
            "kv_offload_gb)",
            field="image",
        )
    head = max(current, key=lambda t: (t.generation, t.created_at))
    engine = head.engine
    if req.strategy == "rolling":
        if g.task_type != "inference":
            raise ValidationFailed(
                f"a rolling update is for inference services (this is {g.task_type}); use "
                "strategy recreate",
                field="strategy",
            )
        if g.parallelism == "pipeline":
            raise ValidationFailed(
                "pipeline stages run as one gang and cannot be replaced one by one; use "
                "strategy recreate",
                field="strategy",
            )
        fixed = [p.host_port for p in ports_from_dicts(head.ports) if not p.from_pool]
        fixed = [p for p in fixed if p]
        if fixed:
            raise ValidationFailed(
                f"fixed host port(s) {fixed}: the new replica cannot run beside the old one "
                "on the same port; use strategy recreate",
                field="strategy",
            )
    image = changes.get("image")
    if image is not None:
        guessed, _ = resolve_engine("", "", image)
        if engine and guessed and guessed != engine:
            raise ValidationFailed(
                f"image {image!r} looks like a {guessed} image, but this service runs "
                f"{engine}; the engine cannot change in an update (create a new service)",
                field="image",
            )
    kv = changes.get("kv_offload_gb")
    if kv is not None and kv != head.kv_offload_gb and (image is None or image == head.image):
        raise ValidationFailed(
            "kv_offload_gb changes only together with a new image (C12): the offload "
            "flag's form depends on the engine's version",
            field="kv_offload_gb",
        )
    spec = TaskSpec.model_construct(
        image=changes.get("image", head.image),
        gpu_required=head.gpu_required,
        gpu_type=head.gpu_type,
        model_path=head.model_path,
        command=list(changes.get("command", head.command)),
        engine_args=list(changes.get("engine_args", head.engine_args)),
        env=list(changes.get("env", head.env)),
        kv_offload_gb=changes.get("kv_offload_gb", head.kv_offload_gb),
    )
    nodes = [
        n for n in read_fleet(s, clock, offline_after_s).nodes if n.visible_to(g.tenant_id)
    ]
    try:
        check_task(
            spec, engine=engine, task_type=g.task_type, parallelism=g.parallelism,
            gpus=head.gpu_required, nodes=nodes, env_allow=env_allow,
        )
    except ValidationFailed as exc:  # the update's body holds the task's fields at its top
        field_ = (exc.field or "").removeprefix("task.") or None
        raise ValidationFailed(exc.message, field=field_) from exc
    return changes


def _describe(head: Task, changes: Mapping[str, Any]) -> str:
    parts = []
    for k, v in changes.items():
        old = getattr(head, k)
        parts.append(f"{k} {old!r} -> {v!r}" if k == "image" else f"{k} {v!r}")
    return "; ".join(parts)


def _current(s: Session, group_id: str) -> list[Task]:
    return list(
        s.scalars(
            select(Task)
            .where(Task.group_id == group_id, Task.replaced_by == "")
            .order_by(Task.rank, Task.created_at)
            .execution_options(populate_existing=True)
        )
    )


def start_update(
    s: Session,
    who: Principal,
    clock: Clock,
    group_id: str,
    req: TaskGroupUpdate,
    *,
    holder: str,
    policy: RolloutPolicy,
    env_allow: Sequence[str] = DEFAULT_ENV_ALLOW,
    offline_after_s: float,
) -> TaskGroupRead:
    """Start an update (``PUT .../update``): 404 for a group ``who`` cannot see, 409 while
    another update runs or the service is stopped or asleep, 400 naming a bad field (the
    nodes the create's rule reads are the fleet's, online by ``offline_after_s``)."""
    get_group(s, who, group_id)  # 404 across tenants and for deleted groups
    g = s.get(TaskGroup, group_id, populate_existing=True)
    assert g is not None
    now = clock.now()
    if g.rollout_holder and g.rollout_expires_at is not None and g.rollout_expires_at >= now:
        raise Conflict(
            f"an update to generation {g.current_generation} is already running "
            f"({g.rolling_update_state}: {g.rolling_update_message}); wait for it to end",
        )
    if g.desired != RUNNING:
        raise Conflict(f"service {g.id} is stopped; start it before updating it")
    current = _current(s, g.id)
    if not current:
        raise Conflict(f"service {g.id} has no replica to update")
    asleep = [t.id for t in current if TaskStatus(t.status) in _ASLEEP]
    if asleep:
        raise Conflict(
            f"service {g.id} is asleep ({', '.join(asleep)}); wake it before updating it"
        )
    changes = _check(s, clock, g, current, req, env_allow, offline_after_s)
    if g.rollout_holder:  # an update whose holder died that the scan has not failed yet
        _abandon_expired(s, clock, g, policy)
    gen = g.current_generation
    ranks = sorted({t.rank for t in current})
    p = Progress(
        strategy=Strategy(req.strategy),
        generation=gen + 1,
        from_generation=gen,
        batch_size=min(req.batch_size, max(1, len(ranks))),
        # only a service behind the gateway has requests to finish before a stop
        drain=g.task_type == "inference",
        progress_at=now,  # the progress deadline counts from here (issue 26)
    )
    state = RolloutState.ROLLING if p.strategy == Strategy.ROLLING else RolloutState.RECREATING
    head = max(current, key=lambda t: (t.generation, t.created_at))
    if p.strategy == Strategy.ROLLING:
        # N2: a batch's new replicas run beside the old ones; they count meanwhile
        quotas.lock_tenant(s, g.tenant_id)
        quotas.require(
            s, g.tenant_id, quotas.per_replica(head).times(p.batch_size),
            f"a rolling update in batches of {p.batch_size} (new replicas run beside the "
            "old until they are switched in; strategy recreate needs none)",
        )
    what = _describe(head, changes)
    how = (
        f"batches of {p.batch_size} over {len(ranks)} replica(s)"
        if p.strategy == Strategy.ROLLING
        else f"{len(ranks)} replica(s) stopped, then created"
    )
    message = f"{req.strategy} update to generation {gen + 1} submitted ({how})"
    spec = {
        **progress_to_json(p),
        "changes": changes,
        "by": who.username,
        "submitted_at": now.isoformat(),
    }
    moved = s.execute(
        update(TaskGroup)
        .where(
            TaskGroup.id == g.id,
            TaskGroup.current_generation == gen,
            or_(TaskGroup.rollout_holder == "", TaskGroup.rollout_expires_at < now),
        )
        .values(
            current_generation=gen + 1,
            rollout_holder=holder,
            rollout_expires_at=now + timedelta(seconds=policy.lease_ttl_s),
            rollout_started_at=now,
            rollout_spec=spec,
            rolling_update_state=state.value,
            rolling_update_message=message,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"another update of service {g.id} started first; see its state")
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=EventKind.ROLLOUT_STARTED.value,
            message=f"{message} by {who.username}: {what}", created_at=now,
        )
    )
    log.info("group %s: %s by %s: %s", g.id, message, who.username, what)
    s.flush()
    s.expire_all()
    return get_group(s, who, g.id)


# ---- drive (J1, J2) ---------------------------------------------------------------------


def _replicas(s: Session, group_id: str) -> tuple[list[Task], list[Replica]]:
    tasks = list(
        s.scalars(
            select(Task)
            .where(Task.group_id == group_id)
            .order_by(Task.created_at, Task.id)
            .execution_options(populate_existing=True)
        )
    )
    return tasks, [
        Replica(
            id=t.id,
            rank=t.rank,
            generation=t.generation,
            status=TaskStatus(t.status),
            replaced_by=t.replaced_by,
            draining=bool(t.draining),
            running_at=t.running_at,
            message=t.status_message or "",
        )
        for t in tasks
    ]


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


def held_by(s: Session, holder: str) -> list[str]:
    """The groups whose rollout ``holder`` holds."""
    return list(
        s.scalars(
            select(TaskGroup.id).where(TaskGroup.rollout_holder == holder).order_by(TaskGroup.id)
        )
    )


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
    tasks, reps = _replicas(s, g.id)
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


def _candidate(
    src: Task, g: TaskGroup, p: Progress, changes: Mapping[str, Any] | None, now: datetime
) -> Task:
    """A new replica of ``src``'s rank (``services.replicas.new_replica``: its intent,
    placement stripped, pool ports given back) — with the update's ``changes`` at the
    update's generation, or as it was (``changes`` None: a restore) — as a candidate."""
    restore = changes is None
    generation = src.generation if restore else p.generation
    what = (
        f"restores generation {generation} (rollback)" if restore
        else f"generation {generation} (update)"
    )
    return new_replica(
        src,
        rank=src.rank,
        message=f"new replica of rank {src.rank}: {what}; waiting for the scheduler",
        health_check=g.health_check,
        now=now,
        generation=generation,
        replaced_by=CANDIDATE,
        changes=None if restore else changes,
    )


def _promote(s: Session, clock: Clock, pr: Promote, why: str) -> bool:
    """Switch a rank to its candidate: the old replicas' ``replaced_by`` -> the candidate
    (compare-and-set: still current), the candidate's -> "" (still a candidate), then the
    old ones are asked to stop — after the switch, so the group's status never reads the
    rank as stopping. False (nothing done) when the candidate is no longer one."""
    moved = s.execute(
        update(Task)
        .where(Task.id == pr.candidate, Task.replaced_by == CANDIDATE)
        .values(replaced_by="")
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        return False
    for old in pr.olds:
        s.execute(
            update(Task)
            .where(Task.id == old, Task.replaced_by == "")
            .values(replaced_by=pr.candidate)
            .execution_options(synchronize_session=False)
        )
    s.flush()
    s.expire_all()
    for old in pr.olds:
        t = s.get(Task, old)
        if t is not None:
            ask_stop(s, clock, t, f"{why}: replaced by {pr.candidate}")
    return True


def apply(
    s: Session, clock: Clock, g: TaskGroup, st: Step, tasks: Mapping[str, Task]
) -> None:
    """Write one step of ``g``'s rollout (in the caller's transaction)."""
    now = clock.now()
    spec = dict(g.rollout_spec)
    p = st.progress
    why = f"rolling update to generation {p.generation}"
    changes: Mapping[str, Any] = spec.get("changes") or {}
    created: dict[int, str] = {}
    for c in st.create:
        src = tasks.get(c.source) or s.get(Task, c.source)
        if src is None:
            continue
        new = _candidate(src, g, p, None if c.restore else changes, now)
        s.add(new)
        created[c.rank] = new.id
    if created:
        s.flush()
        p = replace(p, candidates={**p.candidates, **created})
    for tid in st.undrain:
        t = s.get(Task, tid)
        if t is not None and t.draining:
            draining.mark(s, clock, t, False, f"({why}: it serves on)")
    for tid in st.drain:
        t = s.get(Task, tid)
        if t is not None and not t.draining:
            draining.mark(s, clock, t, True, f"by the {why}")
    switched = False
    for pr in st.promote:
        switched |= _promote(s, clock, pr, why)
    for tid in st.stop:
        t = s.get(Task, tid)
        if t is not None:
            ask_stop(s, clock, t, f"{why}: {st.message}")
    for kind, text in st.events:
        s.add(Event(group_id=g.id, task_id=None, kind=kind.value, message=text, created_at=now))
        log.info("group %s: %s", g.id, text)
    g = s.get(TaskGroup, g.id) or g
    g.rollout_spec = {**spec, **progress_to_json(p)}
    if g.rolling_update_state != st.state.value or g.rolling_update_message != st.message:
        g.rolling_update_state = st.state.value
        g.rolling_update_message = st.message
        g.updated_at = now
    if st.finished:
        g.rollout_holder = ""
        g.rollout_expires_at = None
    s.flush()
    if switched or st.stop:
        refresh_group_status(s, clock, g.id, st.message)


# ---- the expiry scan (J4) ---------------------------------------------------------------


@dataclass
class ScanResult:
    failed: list[str] = field(default_factory=list)  # groups whose rollout was failed
    stopped: list[str] = field(default_factory=list)  # orphaned candidates stopped
    drained: list[str] = field(default_factory=list)  # ... or drained first


def _abandon_expired(
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
    tasks, reps = _replicas(s, g.id)
    try:
        p = progress_from_json(g.rollout_spec)
    except (KeyError, ValueError):
        p = Progress(Strategy.ROLLING, g.current_generation, g.current_generation)
    hard = g.deleted_at is not None or g.desired != RUNNING
    st = abandon(p, reps, reason, hard=hard)
    apply(s, clock, g, st, {t.id: t for t in tasks})
    log.warning("group %s: rollout failed: %s", g.id, reason)
    return st


def _last_drained(s: Session, task_ids: list[str]) -> dict[str, datetime]:
    if not task_ids:
        return {}
    rows = s.execute(
        select(Event.task_id, func.max(Event.created_at))
        .where(Event.task_id.in_(task_ids), Event.kind == EventKind.DRAIN.value)
        .group_by(Event.task_id)
    )
    return {str(t): at for t, at in rows}


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
        st = _abandon_expired(s, clock, g, policy)
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
    reps = [
        Replica(
            id=t.id, rank=t.rank, generation=t.generation, status=TaskStatus(t.status),
            replaced_by=t.replaced_by, draining=bool(t.draining), running_at=t.running_at,
        )
        for t in cands
    ]
    since = _last_drained(s, [t.id for t in cands if t.draining])
    stop, drain = orphans(reps, owned, since.get, now, policy)
    by_id = {t.id: t for t in cands}
    for tid in drain:
        draining.mark(s, clock, by_id[tid], True, "(a new replica of an update that ended)")
        out.drained.append(tid)
    for tid in stop:
        ask_stop(s, clock, by_id[tid], "a new replica of an update that ended; stopped")
        out.stopped.append(tid)
    return out
