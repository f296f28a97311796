"""Sleep and wake (F1, F2, F3, F5): the state side; the agent does the engine side.

**Sleep** moves a running inference task to ``sleeping`` through the state door. The
task keeps its node, its cards' commitment, its host ports and its inference-container
slot (``HOLDS_RESOURCES``); the gateway stops routing to it at once (only ``running``
is routable). At its next heartbeat, or sooner through its light poll, the agent puts
the engine to sleep: vLLM's ``POST /sleep?level=2`` where the engine has it, then the
engine is stopped — the container is kept (Docker) for the wake — and its memory is
released. Health checks pause and their counter resets (D2).

**Wake** moves ``sleeping`` to ``waking`` when the task's node is online and no
training task borrowed its cards while it slept (F5). The agent then starts the same
container again (Docker) or relaunches the engine (process runtime), tracks its health
with a fresh start period and reports ``running`` when it passes (F2), or ``failed``
when its load stalls (D5: no fixed limit, the agent's ``load_stall_s``) or its container
is gone (the recovery loop rebuilds a failed task). When the wake cannot happen now (F3) the task
stays ``sleeping`` with ``wake_requested`` set, the answer's ``branch`` says why
(``node_offline``, ``card_borrowed``) and a ``task.wake_deferred`` event records it;
``wake_retry.retry_wakes`` (the leader's ``WakeRetrier`` loop) wakes it once the node is back or
the cards are free, or fails it once its node has been gone ``node_lost_after_s``, so
the recovery loop rebuilds it elsewhere. Nothing is ever silent.

**A gang sleeps and wakes whole** (issue 32, G3). The stages of a ``pipeline`` group
meet at one rendezvous: a stage that slept alone would leave its peers hanging in a
collective, and one woken alone would wait for peers that are gone. So a sleep or a wake
of any stage — through the task's route, the group's, the idle timer, a window or a
request's wake — acts on every current stage of its gang in one transaction: a gang
sleeps only when every stage runs (else 409 naming the stage that does not, and nothing
moves), and wakes only when no stage is blocked (else every stage keeps sleeping with
``wake_requested`` and one ``task.wake_deferred`` for the gang, on the blocked stage).
A gang's stages sleep the stopped way (``core.engines.sleep``: vLLM's sleep mode across
a pipeline is not proven), so a wake starts every stage again from its placement, which
it kept; it serves once rank 0 does (only rank 0 is routed).

Who calls: the API (``who`` is the caller: what it may not see is 404, the rule in
services/identity/access.py), the idle timer and the gateway's wake-on-request (``who=None``:
the platform).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy import update as sql_update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.events import EventKind
from heteroflow.core.states import HOLDS_RESOURCES, TaskStatus
from heteroflow.db.tables import Event, Node, Task, TaskGroup
from heteroflow.schemas.sleep import GroupSleepResult, NodeTaskLife, WakeBranch, WakeResult
from heteroflow.schemas.task_groups import TaskRead
from heteroflow.services.identity.access import visible_group, visible_task
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle.transitions import note, transition
from heteroflow.services.views import task_read

__all__ = [
    "DEFAULT_OFFLINE_AFTER_S",
    "WakeResult",
    "node_task_life",
    "sleep_group",
    "sleep_group_result",
    "sleep_task",
    "wake_blocker",
    "wake_group",
    "wake_task",
]

# ``ServerSettings.node_offline_after_s``'s default; callers pass their setting.
DEFAULT_OFFLINE_AFTER_S = 20.0
_ATTEMPTS = 5  # compare-and-set retries when the agent moves the task meanwhile
T = TaskStatus
# Not asleep and not failed, but on its way up: a wake has nothing to do.
_ON_ITS_WAY = frozenset({T.PENDING, T.SCHEDULED, T.STARTING})
_ENDED = frozenset({T.STOPPING, T.STOPPED, T.COMPLETED})


# -- reading ---------------------------------------------------------------------------


def _task(s: Session, who: Principal | None, task_id: str) -> Task:
    if who is not None:
        return visible_task(s, who, task_id)
    t = s.get(Task, task_id)
    if t is None:
        raise NotFound(f"task {task_id!r} not found")
    return t


def _fresh(s: Session, task_id: str) -> Task:
    t = s.get(Task, task_id, populate_existing=True)
    if t is None:  # pragma: no cover - tasks are never deleted
        raise NotFound(f"task {task_id!r} not found")
    return t


def _group(s: Session, who: Principal | None, group_id: str) -> TaskGroup:
    if who is not None:
        return visible_group(s, who, group_id)
    g = s.get(TaskGroup, group_id)
    if g is None or g.deleted_at is not None:
        raise NotFound(f"task group {group_id!r} not found")
    return g


def _current_tasks(s: Session, group_id: str) -> list[Task]:
    q = (
        select(Task)
        .where(Task.group_id == group_id, Task.replaced_by == "")
        .order_by(Task.generation, Task.rank)
    )
    return list(s.scalars(q))


def _by(who: Principal | None, reason: str) -> str:
    """`` by alice (why)`` for a person; ``: why`` (or `` by the platform``) for the
    platform — what follows "put to sleep" / "woken" in a status message."""
    if who is None:
        return f": {reason}" if reason else " by the platform"
    return f" by {who.username}" + (f" ({reason})" if reason else "")


def _only_inference(t: Task, what: str) -> None:
    if t.task_type != "inference":
        raise Conflict(
            f"task {t.id} is a {t.task_type} task: only inference services {what} (F1)"
        )


# -- sleep -----------------------------------------------------------------------------


def sleep_task(
    s: Session, clock: Clock, who: Principal | None, task_id: str, reason: str = ""
) -> TaskRead:
    """running -> sleeping (F1). Idempotent for a task already asleep; 409 naming its
    state for any other; 404 for a task ``who`` may not see. A gang's stage sleeps with
    its whole gang."""
    t = _task(s, who, task_id)
    _only_inference(t, "sleep")
    stages = _gang_of(s, t)
    if stages is None:
        _sleep(s, clock, t, f"put to sleep{_by(who, reason)}")
    else:
        _sleep_gang(s, clock, stages, f"put to sleep with its gang{_by(who, reason)}")
    return task_read(_fresh(s, t.id))


def _gang_of(s: Session, t: Task) -> list[Task] | None:
    """The current stages of ``t``'s gang, by rank; None when ``t`` is no current stage
    of a ``pipeline`` group."""
    if t.replaced_by:
        return None
    g = s.get(TaskGroup, t.group_id)
    if g is None or g.parallelism != "pipeline":
        return None
    return _current_tasks(s, g.id)


def gang_sleep_blocker(stages: list[Task]) -> Task | None:
    """The first stage that keeps a gang from sleeping: one neither running nor asleep
    (a gang sleeps whole or not at all). Pure over the stages as read."""
    return next(
        (t for t in stages if T(t.status) not in (T.RUNNING, T.SLEEPING)), None
    )


def _sleep_gang(s: Session, clock: Clock, stages: list[Task], message: str) -> list[str]:
    """Every running stage of a gang -> sleeping, or none (409 naming the stage that is
    neither running nor asleep). The ids put to sleep ([] when it already slept)."""
    fresh = [_fresh(s, t.id) for t in stages]
    o = gang_sleep_blocker(fresh)
    if o is not None:
        hint = " (wait until it runs)" if T(o.status) in (T.WAKING, *_ON_ITS_WAY) else ""
        raise Conflict(
            f"stage {o.rank} of the gang ({o.id}) is {o.status}: a pipeline gang sleeps "
            f"whole, once every stage runs{hint}"
        )
    out: list[str] = []
    for t in fresh:
        if T(t.status) == T.SLEEPING:
            continue
        if not transition(s, clock, t.id, T.RUNNING, T.SLEEPING, message):
            # the caller's transaction rolls back: never half asleep
            raise Conflict(f"stage {t.rank} of the gang ({t.id}) changed state; retry")
        _set_wake_requested(s, t.id, T.SLEEPING, False)
        out.append(t.id)
    return out


def _sleep(s: Session, clock: Clock, t: Task, message: str) -> bool:
    """True when this call put it to sleep; False when it already slept."""
    for _ in range(_ATTEMPTS):
        status = T(_fresh(s, t.id).status)
        if status == T.SLEEPING:
            return False
        if status != T.RUNNING:
            hint = " (wait until it runs)" if status in (T.WAKING, *_ON_ITS_WAY) else ""
            raise Conflict(
                f"task {t.id} is {status}: only a running inference task can sleep{hint}"
            )
        if transition(s, clock, t.id, T.RUNNING, T.SLEEPING, message):
            _set_wake_requested(s, t.id, T.SLEEPING, False)
            return True
    raise Conflict(f"task {t.id} kept changing state; retry")


def sleep_group_result(
    s: Session, clock: Clock, group_id: str, reason: str = "", *, who: Principal | None = None
) -> GroupSleepResult:
    """Every running current task of an inference service -> sleeping; the others are
    listed with their status (nothing to put to sleep is not an error)."""
    g = _group(s, who, group_id)
    if g.task_type != "inference":
        raise Conflict(f"service {g.id} is a {g.task_type} group: only inference services sleep")
    out = GroupSleepResult(group_id=g.id)
    message = f"put to sleep{_by(who, reason)}"
    if g.parallelism == "pipeline":  # issue 32: the gang sleeps whole or not at all
        stages = [_fresh(s, t.id) for t in _current_tasks(s, g.id)]
        if gang_sleep_blocker(stages) is not None:
            out.skipped.update((t.id, t.status) for t in stages)
            return out
        out.slept = _sleep_gang(s, clock, stages, message)
        out.skipped.update(
            (t.id, T.SLEEPING.value) for t in stages if t.id not in out.slept
        )
        return out
    for t in _current_tasks(s, g.id):
        try:
            slept = _sleep(s, clock, t, message)
        except Conflict:
            out.skipped[t.id] = _fresh(s, t.id).status
            continue
        if slept:
            out.slept.append(t.id)
        else:
            out.skipped[t.id] = T.SLEEPING.value
    return out


def sleep_group(
    s: Session, clock: Clock, group_id: str, reason: str = "", *, who: Principal | None = None
) -> list[str]:
    """``sleep_group_result`` for the idle timer: the ids it put to sleep."""
    return sleep_group_result(s, clock, group_id, reason, who=who).slept


# -- wake ------------------------------------------------------------------------------


def wake_task(
    s: Session,
    clock: Clock,
    who: Principal | None,
    task_id: str,
    reason: str = "",
    *,
    offline_after_s: float = DEFAULT_OFFLINE_AFTER_S,
) -> WakeResult:
    """Wake one task; the result's ``branch`` says what happens (see schemas/sleep.py).

    409 for a task that is stopping, stopped or completed (start the service instead) or
    not an inference task; 404 for one ``who`` may not see."""
    t = _task(s, who, task_id)
    _only_inference(t, "sleep and wake")
    stages = _gang_of(s, t)
    if stages is not None:  # a stage wakes with its whole gang
        results = _wake_gang(s, clock, stages, _by(who, reason), offline_after_s)
        return next(r for r in results if r.task_id == t.id)
    return _wake(s, clock, t, _by(who, reason), offline_after_s)


def wake_group(
    s: Session,
    clock: Clock,
    group_id: str,
    reason: str = "",
    *,
    who: Principal | None = None,
    offline_after_s: float = DEFAULT_OFFLINE_AFTER_S,
) -> list[WakeResult]:
    """Wake every current task of an inference service (stopped ones are left alone)."""
    g = _group(s, who, group_id)
    if g.task_type != "inference":
        raise Conflict(f"service {g.id} is a {g.task_type} group: only inference services wake")
    if g.desired == "stopped":
        raise Conflict(f"service {g.id} was stopped by its owner: start it instead of waking it")
    by = _by(who, reason)
    if g.parallelism == "pipeline":
        return _wake_gang(s, clock, _current_tasks(s, g.id), by, offline_after_s)
    return [
        _wake(s, clock, t, by, offline_after_s)
        for t in _current_tasks(s, g.id)
        if T(t.status) not in _ENDED
    ]


def _wake_gang(
    s: Session, clock: Clock, stages: list[Task], by: str, offline_after_s: float
) -> list[WakeResult]:
    """Wake a gang whole: every sleeping stage -> waking in this transaction, or — when
    any stage cannot wake now (F3) — none, the wake requested on each and said once for
    the gang. A gang with a failed stage is being rebuilt as one (recovery): not woken."""
    fresh = [t for t in (_fresh(s, x.id) for x in stages) if T(t.status) not in _ENDED]
    asleep = [t for t in fresh if T(t.status) == T.SLEEPING]
    asleep_ids = {t.id for t in asleep}
    failed = next((t for t in fresh if T(t.status) == T.FAILED), None)
    if not asleep:  # nothing to wake: each stage's own answer (running, waking, ...)
        return [_wake(s, clock, t, by, offline_after_s) for t in fresh]
    if failed is not None:
        why = (
            f"stage {failed.rank} of its gang ({failed.id}) failed: the gang is rebuilt "
            "as one, not woken"
        )
        return [_failed(s, t) if t is failed else _result(t, "failed", why) for t in fresh]
    now = clock.now()
    for t in asleep:
        blocked = _blocker(s, now, t, offline_after_s)
        if blocked is not None:
            branch, why = blocked
            _defer_gang(s, clock, asleep, t, why)
            return [
                _result(_fresh(s, x.id), branch, _fresh(s, x.id).status_message)
                if x.id in asleep_ids else _wake(s, clock, x, by, offline_after_s)
                for x in fresh
            ]
    out: list[WakeResult] = []
    for t in fresh:
        if t.id not in asleep_ids:
            out.append(_wake(s, clock, t, by, offline_after_s))
            continue
        if not transition(s, clock, t.id, T.SLEEPING, T.WAKING, f"woken with its gang{by}"):
            raise Conflict(f"stage {t.rank} of the gang ({t.id}) changed state; retry")
        _set_wake_requested(s, t.id, T.WAKING, False)
        out.append(_result(
            _fresh(s, t.id), "waking",
            f"task {t.id} is waking with its gang ({len(asleep)} stage(s)) on node "
            f"{_node_name(s, t.node_id)}; the gang serves once rank 0 passes its health check",
        ))
    return out


def _defer_gang(s: Session, clock: Clock, asleep: list[Task], blocked: Task, why: str) -> None:
    """A gang's wake that must wait: every sleeping stage keeps ``wake_requested`` and the
    reason; one ``task.wake_deferred`` for the gang, on the stage that blocks it."""
    said = f"gang wake requested: stage {blocked.rank} ({blocked.id}): {why}"
    for t in asleep:
        if t.id == blocked.id:
            _defer(s, clock, t, said)
        elif not (t.wake_requested and t.status_message == said):
            _set_wake_requested(s, t.id, T.SLEEPING, True)
            note(s, clock, t.id, T.SLEEPING, None, said, t.node_id)


def _result(t: Task, branch: WakeBranch, message: str) -> WakeResult:
    return WakeResult(
        task_id=t.id,
        status=t.status,
        branch=branch,
        message=message,
        wake_requested=bool(t.wake_requested),
    )


def _wake(s: Session, clock: Clock, t: Task, by: str, offline_after_s: float) -> WakeResult:
    for _ in range(_ATTEMPTS):
        t = _fresh(s, t.id)
        status = T(t.status)
        where = _node_name(s, t.node_id)
        if status == T.RUNNING:
            return _result(t, "already_running", f"task {t.id} is running on node {where}")
        if status == T.WAKING:
            return _result(t, "waking", f"task {t.id} is already waking on node {where}")
        if status in _ON_ITS_WAY:
            return _result(t, "starting", f"task {t.id} is {status}: not asleep, on its way up")
        if status == T.FAILED:
            return _failed(s, t)
        if status in _ENDED:
            raise Conflict(
                f"task {t.id} is {status}: a stopped service is started again, not woken"
            )
        blocked = _blocker(s, clock.now(), t, offline_after_s)
        if blocked is not None:
            branch, why = blocked
            _defer(s, clock, t, why)
            return _result(_fresh(s, t.id), branch, why)
        if transition(s, clock, t.id, T.SLEEPING, T.WAKING, f"woken{by}"):
            _set_wake_requested(s, t.id, T.WAKING, False)
            return _result(
                _fresh(s, t.id),
                "waking",
                f"task {t.id} is waking on node {where}: its engine starts again and it "
                "serves once its health check passes",
            )
    raise Conflict(f"task {t.id} kept changing state; retry")


def wake_blocker(
    s: Session, clock: Clock, t: Task, *, offline_after_s: float = DEFAULT_OFFLINE_AFTER_S
) -> tuple[WakeBranch, str] | None:
    """The check a wake of a sleeping task makes now (node offline, card borrowed), for a
    caller that must say what a wake would do without doing it (a dry run's dedup)."""
    return _blocker(s, clock.now(), t, offline_after_s)


def _node_name(s: Session, node_id: str | None) -> str:
    node = s.get(Node, node_id) if node_id else None
    return node.name if node is not None else str(node_id or "(none)")


def _blocker(
    s: Session, now: datetime, t: Task, offline_after_s: float
) -> tuple[WakeBranch, str] | None:
    """Why a sleeping task cannot wake right now (F3), or None when it can."""
    node = s.get(Node, t.node_id) if t.node_id else None
    if node is None or node.last_heartbeat_at < now - timedelta(seconds=offline_after_s):
        name = node.name if node is not None else str(t.node_id)
        since = (
            f" since {node.last_heartbeat_at:%Y-%m-%d %H:%M:%S} UTC" if node is not None else ""
        )
        return (
            "node_offline",
            f"wake requested: node {name} is offline (no heartbeat{since}); the task "
            "wakes when the node is back, or is failed and rebuilt elsewhere if it stays away",
        )
    borrower = _borrower(s, t)
    if borrower is not None:
        o, cards = borrower
        return (
            "card_borrowed",
            f"wake requested: card(s) {cards} of node {node.name} are borrowed by "
            f"{o.task_type} task {o.name} ({o.id}) while this service slept; it wakes "
            "when that work ends",
        )
    return None


def _borrower(s: Session, t: Task) -> tuple[Task, list[int]] | None:
    """A non-inference task holding any of a sleeping task's cards (F5's borrower)."""
    mine = set(t.gpu_ids)
    if not mine or not t.node_id:
        return None
    q = (
        select(Task)
        .where(
            Task.node_id == t.node_id,
            Task.id != t.id,
            Task.task_type != "inference",
            Task.status.in_([x.value for x in HOLDS_RESOURCES]),
        )
        .order_by(Task.created_at)
    )
    for o in s.scalars(q):
        shared = sorted(mine & set(o.gpu_ids))
        if shared:
            return o, shared
    return None


def _defer(s: Session, clock: Clock, t: Task, why: str) -> None:
    """Record a wake that must wait (flag + one ``task.wake_deferred`` event per distinct
    reason: the gateway may ask again on every request)."""
    if t.wake_requested and t.status_message == why:
        return
    _set_wake_requested(s, t.id, T.SLEEPING, True)
    note(s, clock, t.id, T.SLEEPING, EventKind.WAKE_DEFERRED, why, t.node_id)


def _set_wake_requested(s: Session, task_id: str, status: TaskStatus, value: bool) -> None:
    s.execute(
        sql_update(Task)
        .where(Task.id == task_id, Task.status == status.value)
        .values(wake_requested=value)
        .execution_options(synchronize_session=False)
    )


def _failed(s: Session, t: Task) -> WakeResult:
    """A failed task: say whether the wake found its container gone (F3)."""
    last_fault = s.scalar(
        select(Event.kind)
        .where(Event.task_id == t.id, Event.kind.like("fault.%"))
        .order_by(Event.id.desc())
        .limit(1)
    )
    last_move = s.scalar(
        select(Event.from_status)
        .where(Event.task_id == t.id, Event.kind == EventKind.TASK_STATUS.value)
        .order_by(Event.id.desc())
        .limit(1)
    )
    after = f"; rebuilt as {t.replaced_by}" if t.replaced_by else "; the recovery loop rebuilds it"
    if last_fault == EventKind.CONTAINER_LOST.value and last_move == T.WAKING.value:
        return _result(
            t, "container_gone", f"task {t.id}: its container was gone at wake{after}"
        )
    return _result(t, "failed", f"task {t.id} failed: {t.status_message}{after}")


# -- the agent's poll (the leader's wake round: services/lifecycle/wake_retry.py) ----


def node_task_life(s: Session, node_id: str) -> NodeTaskLife:
    """The agent's light poll: its node's sleeping and waking tasks (one indexed read)."""
    out = NodeTaskLife()
    if not node_id:
        return out
    q = select(Task.id, Task.status).where(
        Task.node_id == node_id, Task.status.in_([T.SLEEPING.value, T.WAKING.value])
    )
    for task_id, status in s.execute(q):
        (out.sleeping if status == T.SLEEPING.value else out.waking).append(task_id)
    return out
