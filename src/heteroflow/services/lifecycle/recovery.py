"""The recovery loop's round (E1-E4, A10): what failed comes back, what is lost moves.

One round (``recover``), in one fenced transaction of the leader (controllers/recovery.py):

1. **Lost nodes (E4).** A node without a heartbeat for ``node_offline_after_s`` is lost
   (the node watch says so on the timeline); ``node_migrate_after_s`` later its tasks
   move: a ``scheduled`` one goes back to the queue (node, cards and pool ports
   released), a ``starting`` / ``running`` / ``sleeping`` / ``waking`` one fails there
   (``fault.evacuated``, then the transition) and step 4 rebuilds it, a ``stopping`` one
   is taken as stopped. When the node's agent comes back its heartbeat no longer lists
   them, so it stops what it still runs and its zombie cleanup removes the rest.
2. **Lost cards (E4).** A task placed on a card its node no longer reports
   (``fault.gpu_lost``, written by the heartbeat) is moved the same way once the card
   has been missing ``node_migrate_after_s`` (counted from the node's last
   ``fault.gpu_lost``): a glitch of NVML that lasts a heartbeat moves nothing.
3. **Run timeouts (A10).** A training / container task whose engine has been up (since
   its claim) longer than its group's ``run_timeout_seconds`` fails with the reason
   (``fault.run_timeout``). Failed, not completed: it did not finish its work. The
   agent stops the engine at its next heartbeat (the task is no longer listed).
4. **Rebuilds (E1, E3).** Each failed current task of a group that is not deleted and is
   meant to run gets what ``core.recovery.decide`` says: a new task of the same rank and
   generation (``pending``: the scheduler places it, on the same node when it can — the
   model is there —, elsewhere when the node or card is gone), the old one keeps its
   ``failed`` and points at the new one (``replaced_by``); or, past the cap, one
   ``fault.rebuild_gave_up`` and the group's status message says so.

Every real rebuild writes one group-level ``fault.rebuilt`` naming the cause (the failed
task's fault kind and first line of its status message) and, on an engine fallback, the
fallback. ``replace`` is also the door ``task_groups.start_group`` uses: the old task's
``replaced_by`` is set by compare-and-set (still the same status, still current), so a
start and a rebuild of the same task cannot both win.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.events import EventKind
from heteroflow.core.ids import new_id
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.recovery import (
    LOST_HARDWARE,
    Attempt,
    GiveUp,
    Rebuild,
    RecoveryPolicy,
    Skip,
    decide,
    evacuation_paused,
    missing_cards,
    run_timed_out,
)
from heteroflow.core.states import AGENT_OWNED, ENGINE_UP, TaskStatus
from heteroflow.db.tables import Event, Node, Task, TaskGroup
from heteroflow.services.lifecycle import faults
from heteroflow.services.lifecycle.replicas import new_replica  # issue 14: the shared copy rule
from heteroflow.services.lifecycle.transitions import TaskUpdate, refresh_group_status, transition

log = logging.getLogger(__name__)

RUNNING = "running"  # task_groups.desired: the owner wants it up
STOPPED = "stopped"
# the fault kinds that explain a failure (the last one before it is its cause)
CAUSES = frozenset(
    {
        EventKind.CONTAINER_LOST, EventKind.ENGINE_EXITED, EventKind.UNHEALTHY,
        EventKind.LOAD_STALLED,
        EventKind.IMAGE_UNAVAILABLE,  # H7: not found / unauthorised: not pulled again
        EventKind.GPU_LOST, EventKind.NODE_LOST, EventKind.EVACUATED, EventKind.RUN_TIMEOUT,
    }
)
# what moves off a lost node or card: failed there (then rebuilt) ...
_FAIL_OFF = frozenset({*AGENT_OWNED, TaskStatus.SLEEPING})
# ... queued again (never started there), or taken as stopped
_MOVABLE = frozenset({*_FAIL_OFF, TaskStatus.SCHEDULED, TaskStatus.STOPPING})


@dataclass
class RecoveryResult:
    """Task ids each step acted on this round."""

    evacuated: list[str] = field(default_factory=list)  # failed off a lost node / card
    requeued: list[str] = field(default_factory=list)  # scheduled there: queued again
    timed_out: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)  # the new tasks
    gave_up: list[str] = field(default_factory=list)  # the failed tasks left as they are
    # lost nodes whose work was not moved: too many lost at once (core.recovery)
    held: list[str] = field(default_factory=list)
    # lost nodes whose work waits out a whole lost-node delay counted from ``calm_since``
    waiting: list[str] = field(default_factory=list)


def recover(
    s: Session,
    clock: Clock,
    policy: RecoveryPolicy,
    *,
    offline_after_s: float,
    migrate_after_s: float,
    calm_since: datetime | None = None,
) -> RecoveryResult:
    """One level-triggered round; running it twice does nothing more.

    ``calm_since``: since when this leader has seen the fleet without a disruption (it
    took the lease, or the last round that held evacuation): a node's silence counts
    only from then (``evacuate_lost_nodes``).
    """
    out = RecoveryResult()
    evacuate_lost_nodes(s, clock, out, offline_after_s, migrate_after_s,
                        policy.disruption_threshold, calm_since)
    evacuate_lost_cards(s, clock, out, migrate_after_s)
    stop_run_timeouts(s, clock, out)
    rebuild_failed(s, clock, policy, out)
    return out


# ---- 1, 2: work moves off what is lost ---------------------------------------------


def _move_off(s: Session, clock: Clock, t: Task, what: str, out: RecoveryResult) -> None:
    """One task off a lost node or card, through the state door (a lost race: skipped)."""
    status = TaskStatus(t.status)
    if status == TaskStatus.SCHEDULED:
        ports = tuple(p.released() for p in ports_from_dicts(t.ports))
        update_ = TaskUpdate(node_id=None, gpu_ids=(), ports=ports, qos="", started_at=None)
        if transition(s, clock, t.id, status, TaskStatus.PENDING,
                      f"{what}; placed again elsewhere", update=update_):
            out.requeued.append(t.id)
    elif status == TaskStatus.STOPPING:
        transition(s, clock, t.id, status, TaskStatus.STOPPED,
                   f"{what}; its stop is taken as done")
    elif status in _FAIL_OFF:
        message = f"{what}; failed here so that it can be rebuilt elsewhere"
        with s.begin_nested():  # the fault row only with the transition (cause, effect)
            faults.record(
                s, clock, group_id=t.group_id, task_id=t.id, node_id=t.node_id,
                kind=EventKind.EVACUATED, message=f"task {t.name} ({t.id}): {message}",
            )
            if not transition(s, clock, t.id, status, TaskStatus.FAILED, message):
                raise _LostRace
        out.evacuated.append(t.id)


class _LostRace(Exception):
    pass


def evacuate_lost_nodes(
    s: Session,
    clock: Clock,
    out: RecoveryResult,
    offline_after_s: float,
    migrate_after_s: float,
    disruption_threshold: float,
    calm_since: datetime | None = None,
) -> None:
    """Step 1. A node's silence counts from ``calm_since`` at the earliest: after a
    disruption (``evacuation_paused``) the nodes come back one by one, and the last ones
    heard must not lose their work for being a second later than the others; a leader
    that just took the lease cannot tell a node's silence from heartbeats that went to
    its dead predecessor. Either way every node gets a whole lost-node delay again."""
    now = clock.now()
    cutoff = now - timedelta(seconds=offline_after_s + migrate_after_s)
    lost = {n.id: n for n in s.scalars(select(Node).where(Node.last_heartbeat_at < cutoff))}
    if not lost:
        return
    tasks = s.scalars(
        select(Task)
        .where(Task.node_id.in_(list(lost)), Task.status.in_([x.value for x in _MOVABLE]))
        .order_by(Task.created_at)
    ).all()
    holding = sorted({lost[str(t.node_id)].name for t in tasks})
    online = s.scalar(
        select(func.count())
        .select_from(Node)
        .where(Node.last_heartbeat_at >= now - timedelta(seconds=offline_after_s))
    )
    if evacuation_paused(len(holding), int(online or 0), disruption_threshold):
        out.held = holding
        _note_held(s, clock, tasks, lost, int(online or 0))
        return
    if calm_since is not None and calm_since > cutoff:
        out.waiting = holding
        return
    for t in tasks:
        node = lost[str(t.node_id)]
        away = (now - node.last_heartbeat_at).total_seconds()
        what = f"node {node.name} lost: no heartbeat for {away:.0f} s"
        try:
            _move_off(s, clock, t, what, out)
        except _LostRace:
            continue


def _note_held(
    s: Session, clock: Clock, tasks: Any, lost: dict[str, Node], online: int
) -> None:
    """One ``fault.evacuation_held`` per group and node loss, on the group's timeline:
    why a lost node's services did not move (the operator's first question)."""
    pairs = sorted({(str(t.node_id), t.group_id) for t in tasks})
    node_ids = sorted({n for n, _ in pairs})
    # each node's current loss: its latest node-level mark, a node_lost (0: not yet written)
    since = {
        n: m.id for n, m in faults.latest_marks(s, node_ids).items()
        if m.kind == EventKind.NODE_LOST
    }
    told = set(
        s.execute(
            select(Event.node_id, Event.group_id, Event.id)
            .where(Event.node_id.in_(node_ids), Event.kind == EventKind.EVACUATION_HELD.value)
        ).all()
    )
    done = {(n, g) for n, g, i in told if i > since.get(str(n), 0)}
    held = len(node_ids)
    for node_id, group_id in pairs:
        if (node_id, group_id) in done:
            continue
        faults.record(
            s, clock, group_id=group_id, node_id=node_id, kind=EventKind.EVACUATION_HELD,
            message=(
                f"node {lost[node_id].name} lost with {held - 1} other node(s) holding work "
                f"at once and {online} heard from: taken for a control-plane fault (a "
                "stalled server, a network split), so its work stays where it is until "
                "most nodes are heard from again (NODE_DISRUPTION_THRESHOLD)"
            ),
        )


def _last_gpu_loss(s: Session, node_ids: list[str]) -> dict[str, datetime]:
    rows = s.execute(
        select(Event.node_id, Event.created_at)
        .where(Event.node_id.in_(node_ids), Event.kind == EventKind.GPU_LOST.value)
        .order_by(Event.id)
    )
    return {str(n): at for n, at in rows}


def evacuate_lost_cards(
    s: Session, clock: Clock, out: RecoveryResult, missing_for_s: float
) -> None:
    now = clock.now()
    # the node is online (or not yet lost): a stopping task is its agent's to finish
    statuses = [x.value for x in _MOVABLE if x != TaskStatus.STOPPING]
    rows = s.execute(
        select(Task.id, Task.gpu_ids, Node)
        .join(Node, Node.id == Task.node_id)
        .where(Task.status.in_(statuses), Task.gpu_required > 0)
        .order_by(Task.created_at)
    ).all()
    off: list[tuple[Task, Node, list[int]]] = []
    for task_id, gpu_ids, n in rows:
        gone = missing_cards([int(i) for i in gpu_ids], [int(g["index"]) for g in n.gpus])
        if gone:
            t = s.get(Task, task_id)
            if t is not None:
                off.append((t, n, gone))
    if not off:
        return
    since = _last_gpu_loss(s, sorted({n.id for _, n, _ in off}))
    for t, n, gone in off:
        at = since.get(n.id)
        if at is not None and (now - at).total_seconds() < missing_for_s:
            continue  # perhaps a glitch of the card's driver: wait a little
        cards = ", ".join(f"GPU {i}" for i in gone)
        what = f"{cards} gone from node {n.name}'s inventory"
        try:
            _move_off(s, clock, t, what, out)
        except _LostRace:
            continue


# ---- 3: run timeouts ---------------------------------------------------------------


def stop_run_timeouts(s: Session, clock: Clock, out: RecoveryResult) -> None:
    now = clock.now()
    rows = s.execute(
        select(Task, TaskGroup.run_timeout_seconds)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(
            Task.status.in_([x.value for x in ENGINE_UP]),
            Task.task_type != "inference",
            TaskGroup.run_timeout_seconds > 0,
        )
    ).all()
    for t, timeout_s in rows:
        since = t.started_at or t.running_at
        if not run_timed_out(since, now, int(timeout_s), t.task_type):
            continue
        assert since is not None
        ran = (now - since).total_seconds()
        message = f"run timeout of {timeout_s} s exceeded (up for {ran:.0f} s); stopped"
        try:
            with s.begin_nested():
                faults.record(
                    s, clock, group_id=t.group_id, task_id=t.id, node_id=t.node_id,
                    kind=EventKind.RUN_TIMEOUT, message=f"task {t.name} ({t.id}): {message}",
                )
                if not transition(s, clock, t.id, TaskStatus(t.status), TaskStatus.FAILED,
                                  message):
                    raise _LostRace
        except _LostRace:
            continue
        out.timed_out.append(t.id)


# ---- 4: rebuilds -------------------------------------------------------------------


def _events_of(s: Session, task_ids: list[str]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = defaultdict(list)
    if task_ids:
        kinds = [EventKind.TASK_STATUS.value, *(k.value for k in CAUSES)]
        for e in s.scalars(
            select(Event)
            .where(Event.task_id.in_(task_ids), Event.kind.in_(kinds))
            .order_by(Event.id)
        ):
            out[str(e.task_id)].append(e)
    return out


def attempt_of(t: Task, events: list[Event]) -> Attempt:
    """A failed task as ``core.recovery`` sees it: when it failed (its last change to
    ``failed``; else its last update) and why (the last fault since the change before)."""
    failed_at, cause = t.updated_at, None
    changes = [i for i, e in enumerate(events) if e.kind == EventKind.TASK_STATUS.value]
    last_failed = next(
        (i for i in reversed(changes) if events[i].to_status == TaskStatus.FAILED.value), None
    )
    if last_failed is not None:
        failed_at = events[last_failed].created_at
        before = [i for i in changes if i < last_failed]
        start = before[-1] + 1 if before else 0
        for e in events[start:last_failed]:
            if e.kind != EventKind.TASK_STATUS.value:
                cause = EventKind(e.kind)
    return Attempt(
        task_id=t.id,
        rebuild_count=t.rebuild_count,
        engine=t.engine,
        image=t.image,
        node_id=t.node_id,
        running_at=t.running_at,
        failed_at=failed_at,
        fault=cause,
    )


def _history(s: Session, first: Attempt, first_group: str, depth: int) -> list[Attempt]:
    """``first`` and the tasks it replaced, newest first, at most ``depth`` in all."""
    chain = [first]
    current = first.task_id
    while len(chain) < depth:
        prev = s.scalar(
            select(Task).where(Task.group_id == first_group, Task.replaced_by == current)
        )
        if prev is None:
            break
        chain.append(attempt_of(prev, _events_of(s, [prev.id])[prev.id]))
        current = prev.id
    return chain


def cause_text(t: Task, fault: EventKind | None) -> str:
    first = next((ln.strip() for ln in (t.status_message or "").splitlines() if ln.strip()), "")
    what = first or "no reason recorded"
    return f"{fault.value}: {what}" if fault is not None else what


def _candidates(s: Session) -> list[tuple[Task, TaskGroup]]:
    """Failed current tasks of live groups meant to run, that the loop has not given up
    on; training / container ones only when lost hardware may explain them."""
    gave_up = exists().where(
        Event.task_id == Task.id, Event.kind == EventKind.REBUILD_GAVE_UP.value
    )
    lost = exists().where(
        Event.task_id == Task.id, Event.kind.in_([k.value for k in LOST_HARDWARE])
    )
    q = (
        select(Task, TaskGroup)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(
            Task.status == TaskStatus.FAILED.value,
            Task.replaced_by == "",
            TaskGroup.deleted_at.is_(None),
            TaskGroup.desired == RUNNING,
            TaskGroup.parallelism != "pipeline",
            # issue 14: a rollout holding its lease owns the group's replicas (it retries
            # or rolls back its own new ones); the loop takes over again once it ended
            TaskGroup.rollout_holder == "",
            ~gave_up,
            or_(Task.task_type == "inference", and_(Task.task_type != "inference", lost)),
        )
        .order_by(Task.updated_at, Task.id)
    )
    return [(t, g) for t, g in s.execute(q).all()]


def rebuild_failed(
    s: Session, clock: Clock, policy: RecoveryPolicy, out: RecoveryResult
) -> None:
    rows = _candidates(s)
    events = _events_of(s, [t.id for t, _ in rows])
    for t, g in rows:
        first = attempt_of(t, events[t.id])
        depth = policy.fallback_after if t.task_type == "inference" else 1
        history = _history(s, first, t.group_id, depth)
        d = decide(
            history, list(g.inference_templates), policy,
            task_type=t.task_type, parallelism=g.parallelism,
        )
        cause = cause_text(t, first.fault)
        if isinstance(d, Skip):
            continue
        if isinstance(d, GiveUp):
            _give_up(s, clock, t, g, d, cause)
            out.gave_up.append(t.id)
            continue
        if not _lock_meant_to_run(s, g.id, clock.now()):
            continue  # stopped or deleted since the read: its owner's word wins
        new = replace(
            s, clock, t, TaskStatus.FAILED,
            count=d.count,
            health_check=dict(g.health_check),
            message=f"rebuilt from {t.id} (rebuild {d.count} of at most "
            f"{policy.max_rebuilds}); waiting for the scheduler",
            rebuild=d,
        )
        if new is None:
            continue  # a start or another round replaced it first
        text = (
            f"rebuilt task {t.name} ({t.id}, rank {t.rank}) as {new.id}: rebuild "
            f"{d.count} of at most {policy.max_rebuilds} in a row; cause: {cause}"
        )
        if d.fallback:
            text += f"; {d.fallback}"
            if t.engine_args:
                text += f" (its engine arguments, written for {t.engine}, are dropped)"
        faults.record(
            s, clock, group_id=g.id, task_id=new.id, node_id=t.node_id,
            kind=EventKind.REBUILT, message=text,
        )
        log.info("group %s: %s", g.id, text)
        refresh_group_status(s, clock, g.id, f"rebuilding {t.name}: {cause}")
        out.rebuilt.append(new.id)


def _lock_meant_to_run(s: Session, group_id: str, now: datetime) -> bool:
    """Write-lock the group while it is live and meant to run (False: not any more).

    A stop writes ``desired`` on this row before it reads the tasks to stop, so a rebuild
    either commits first (and the stop then sees the new task and stops it) or waits for
    the stop and finds it stopped. PostgreSQL: the row lock; SQLite: the write lock.
    """
    moved = s.execute(
        update(TaskGroup)
        .where(
            TaskGroup.id == group_id,
            TaskGroup.deleted_at.is_(None),
            TaskGroup.desired == RUNNING,
        )
        .values(updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(moved, "rowcount", 0))


def _give_up(
    s: Session, clock: Clock, t: Task, g: TaskGroup, d: GiveUp, cause: str
) -> None:
    text = f"task {t.name} ({t.id}, rank {t.rank}): {d.reason}; last failure: {cause}"
    faults.record(
        s, clock, group_id=g.id, task_id=t.id, node_id=t.node_id,
        kind=EventKind.REBUILD_GAVE_UP, message=text,
    )
    log.warning("group %s: recovery gave up: %s", g.id, text)
    g.status_message = f"recovery gave up: {text}; start the service to try again"
    g.updated_at = clock.now()
    s.flush()


def replace(
    s: Session,
    clock: Clock,
    old: Task,
    expected: TaskStatus,
    *,
    count: int,
    health_check: dict[str, Any],
    message: str,
    rebuild: Rebuild | None = None,
) -> Task | None:
    """A new pending task for ``old``'s rank (a copy of its spec: same generation, pool
    ports released, off its node and cards), and ``old.replaced_by`` set — only while
    ``old`` is still ``expected`` and current (compare-and-set); None when it was not.

    With ``rebuild`` carrying another engine (E3 fallback) the copy takes its engine and
    image and drops the engine arguments. The caller refreshes the group's status."""
    nid = new_id("task")
    res = s.execute(
        update(Task)
        .where(Task.id == old.id, Task.status == expected.value, Task.replaced_by == "")
        .values(replaced_by=nid)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return None
    # issue 14: the one rule for a copy of a task's intent (services/lifecycle/replicas.py)
    changes: dict[str, Any] = {}
    if rebuild is not None and rebuild.engine != old.engine:  # E3 fallback
        changes = {
            "image": rebuild.image, "engine": rebuild.engine,
            "engine_reason": rebuild.engine_reason, "engine_args": [],
        }
    new = new_replica(
        old, rank=old.rank, message=message, health_check=health_check, now=clock.now(),
        task_id=nid, rebuild_count=count, changes=changes,
    )
    s.add(new)
    s.flush()
    s.expire(old)  # its replaced_by changed behind the ORM's back
    return new
