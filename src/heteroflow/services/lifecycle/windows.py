"""Schedule windows (K1): the owner's config, and the leader's executor that acts on it.

**The config** (``set_window`` / ``remove_window``, ``PUT`` / ``DELETE
/api/v1/task-groups/{id}/schedule-window``): a ``schemas.windows.ScheduleWindowIn``,
checked against the group (``check_for_group``) and stored as the group's
``schedule_window``. Other tenants' groups are 404, a deleted group is 409. Changing the
window acts on nothing at once: the executor's next round does.

**The executor** (``due_groups`` + ``apply_window``; the leader's loop is
``controllers/windows.py``). ``core.windows.decide`` says what a group's window asks;
this module does it, in the round's fenced transaction, with the group row locked:

- **Act** (the window closed): the current replica count is saved on the group first
  (``window_saved_replicas``) and ``window_action`` set, then ``pause`` puts every
  running task to sleep (``services.sleep``: engines stop, memory is freed, the tasks
  keep their node, cards and ports, so the resume is a wake, not a new placement),
  ``scale`` scales down through the injected ``Scaler`` (``services.scaling``), ``stop``
  stops the group as its owner would (``desired`` stopped). One ``window.pause`` event
  says what was done and when the window opens again.
- **Hold** (still closed, action in effect): nothing — a second round changes nothing,
  and what a person did meanwhile stands (a manual scale-out, a wake, a start). A pause
  only puts back to sleep a replica that came up *by a start* it had not slept: one that
  was on its way up when the window closed, or a rebuild of a failed one by the recovery
  loop — not one woken by a request or a person, not one of a scale-out, not after its
  owner started the service again.
- **Restore** (the window opened, or was disabled or removed): ``pause`` wakes the
  service, ``scale`` scales back to the saved count (never below what runs now, within
  the group's bounds); ``window_action`` cleared; one ``window.resume`` event.
- **Release**: ``stop`` is never undone (its owner starts the service), and a service
  its owner stopped meanwhile is not restored: the action is only cleared, and the
  ``window.resume`` event says why.

An action that cannot run (the scaler refuses, say) leaves nothing half done (a
savepoint), writes one ``window.failed`` per distinct reason, and is tried again next
round. A group a rolling update holds (``rollout_holder``) is left alone until it ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, DomainError
from heteroflow.core.events import EventKind
from heteroflow.core.states import TaskStatus
from heteroflow.core.windows import (
    Act,
    GroupWindowState,
    Hold,
    Idle,
    Release,
    Restore,
    Step,
    Window,
    action_text,
    decide,
    phase,
    zone,
)
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.schemas.windows import (
    ScheduleWindowRead,
    check_for_group,
    parse_window,
    stored_window,
)
from heteroflow.services.identity.access import visible_group
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle import scaling, sleep
from heteroflow.services.lifecycle.task_groups import stop_group_row

log = logging.getLogger(__name__)

T = TaskStatus


class Scaler(Protocol):
    """Sets a group's replica count (scale in or out) as the platform (who = None)."""

    def __call__(
        self, s: Session, clock: Clock, group_id: str, replicas: int, reason: str
    ) -> object: ...


def window_scaler(s: Session, clock: Clock, group_id: str, replicas: int, reason: str) -> object:
    """The ``Scaler`` the server runs with: ``services.scaling`` as the platform (the
    one write of every replica count: a scale-in drains running replicas first)."""
    return scaling.scale_as_platform(s, clock, group_id, replicas, reason)


# -- the config ------------------------------------------------------------------------


def _group_for(s: Session, who: Principal, group_id: str) -> TaskGroup:
    """The group ``who`` may change: 404 when ``who`` may not see it (services/identity/access.py),
    409 once deleted."""
    g = visible_group(s, who, group_id, deleted=True)
    if g.deleted_at is not None:
        raise Conflict(f"task group {group_id} was deleted: its schedule window cannot change")
    return g


def set_window(
    s: Session, who: Principal, clock: Clock, group_id: str, body: object
) -> ScheduleWindowRead:
    """Store the window ``body`` (replacing any); the executor acts on it next round."""
    g = _group_for(s, who, group_id)
    w = parse_window(body)
    check_for_group(
        w,
        task_type=g.task_type,
        parallelism=g.parallelism,
        min_replicas=g.min_replicas,
        max_replicas=g.max_replicas,
        current_replicas=g.current_replicas,
        window_action=g.window_action,
        saved_replicas=g.window_saved_replicas,
    )
    now = clock.now()
    g.schedule_window = w.stored()
    g.updated_at = now
    read = window_read(g, now)
    _event(s, now, g, EventKind.CONFIG_CHANGED, f"schedule window set by {who.username}: "
           f"{read.summary}")
    return read


def get_window(s: Session, who: Principal, clock: Clock, group_id: str) -> ScheduleWindowRead:
    """The window as stored, and where it stands now (404 across tenants, 409 deleted)."""
    return window_read(_group_for(s, who, group_id), clock.now())


def remove_window(s: Session, who: Principal, clock: Clock, group_id: str) -> ScheduleWindowRead:
    """Remove the window; an action it has in effect is undone next round."""
    g = _group_for(s, who, group_id)
    now = clock.now()
    if g.schedule_window:
        g.schedule_window = {}
        g.updated_at = now
        after = f" ({g.window_action} in effect: undone next round)" if g.window_action else ""
        _event(s, now, g, EventKind.CONFIG_CHANGED,
               f"schedule window removed by {who.username}{after}")
    return window_read(g, now)


def _window_of(g: TaskGroup) -> tuple[Window | None, str]:
    """The group's window in force (None: none) and, when None, why."""
    try:
        stored = stored_window(g.schedule_window)
    except ValueError as exc:
        log.warning("group %s: %s", g.id, exc)
        return None, "the stored window no longer reads (see the server log)"
    if stored is None:
        return None, "the window was removed"
    w = stored.to_window()
    return (w, "") if w is not None else (None, "the window was disabled")


def window_read(g: TaskGroup, now: datetime) -> ScheduleWindowRead:
    w, why = _window_of(g)
    if w is None or not w.enabled:
        summary = "no window: the service runs as its owner left it" if not g.schedule_window \
            else f"{why or 'the window is disabled'}: it is not acted on"
        inside, changes_at = None, None
    else:
        now_phase = phase(w, now)
        inside, changes_at = now_phase.inside, now_phase.changes_at
        summary = f"runs {w.describe()}; outside: {action_text(w)}"
    if g.window_action:
        summary += f"; {g.window_action} in effect (saved {g.window_saved_replicas} replica(s))"
    return ScheduleWindowRead(
        group_id=g.id,
        schedule_window=dict(g.schedule_window),
        window_action=g.window_action,
        window_saved_replicas=g.window_saved_replicas,
        inside=inside,
        changes_at=changes_at,
        summary=summary,
    )


# -- the executor ----------------------------------------------------------------------


@dataclass
class WindowOutcome:
    """What one group's window did this round."""

    group_id: str
    step: str  # act | hold | restore | release | failed
    action: str
    message: str
    tasks: list[str] = field(default_factory=list)  # tasks put to sleep or woken

    @property
    def moved_tasks(self) -> bool:
        """Tasks changed state, or the group stopped or scaled: the routing snapshot
        should follow at once."""
        return self.step != "failed" and (bool(self.tasks) or self.action in ("scale", "stop"))


def _state(g: TaskGroup) -> GroupWindowState:
    return GroupWindowState(
        in_effect=g.window_action,
        desired=g.desired,
        current_replicas=g.current_replicas,
        saved_replicas=g.window_saved_replicas,
        min_replicas=g.min_replicas,
        max_replicas=g.max_replicas,
        busy="a rolling update holds the service: the window acts after it"
        if g.rollout_holder
        else "",
    )


def _decide(g: TaskGroup, now: datetime) -> Step:
    w, absent = _window_of(g)
    return decide(w, now, _state(g), absent=absent or "the window was removed")


def due_groups(s: Session, now: datetime) -> list[str]:
    """The groups whose window asks for something at ``now`` (one read of the live
    groups that have a window or an action in effect)."""
    q = (
        select(TaskGroup)
        .where(TaskGroup.deleted_at.is_(None))
        .order_by(TaskGroup.created_at, TaskGroup.id)
    )
    out: list[str] = []
    for g in s.scalars(q):
        if not g.schedule_window and not g.window_action:
            continue
        step = _decide(g, now)
        if isinstance(step, Idle) or (isinstance(step, Hold) and step.action != "pause"):
            continue
        out.append(g.id)
    return out


def apply_window(
    s: Session,
    clock: Clock,
    group_id: str,
    *,
    scaler: Scaler,
    offline_after_s: float = sleep.DEFAULT_OFFLINE_AFTER_S,
) -> WindowOutcome | None:
    """Do what the group's window asks at ``clock.now()`` (decided again here, with the
    group row locked); None when nothing was to be done."""
    now = clock.now()
    g = s.scalars(
        select(TaskGroup)
        .where(TaskGroup.id == group_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one_or_none()
    if g is None or g.deleted_at is not None:
        return None
    step = _decide(g, now)
    if isinstance(step, Idle):
        return None
    if isinstance(step, Hold):
        return _hold(s, clock, g, step)
    try:
        with s.begin_nested():  # nothing half done when the action fails
            if isinstance(step, Act):
                return _act(s, clock, g, step, scaler)
            if isinstance(step, Restore):
                return _restore(s, clock, g, step, scaler, offline_after_s)
            return _release(s, clock, g, step)
    except (DomainError, ValueError) as exc:
        s.expire(g)
        return _failed(s, now, g, step, exc)


def _act(s: Session, clock: Clock, g: TaskGroup, step: Act, scaler: Scaler) -> WindowOutcome:
    now = clock.now()
    w, _ = _window_of(g)
    assert w is not None
    reopens = f"; it opens again {_local(step.reopens_at, w)}" if step.reopens_at else ""
    closed = f"outside its schedule window ({w.describe()})"
    # saved first: whatever happens next, the count to come back to is on the group
    g.window_saved_replicas, g.window_action, g.updated_at = step.save, step.action, now
    s.flush()
    out = WindowOutcome(g.id, "act", step.action, "")
    if step.action == "pause":
        res = sleep.sleep_group_result(s, clock, g.id, f"{closed}{reopens}")
        out.tasks = list(res.slept)
        done = f"paused: {len(res.slept)} task(s) put to sleep" + _ids(res.slept)
        if res.skipped:
            done += "; left as they are: " + ", ".join(
                f"{t} ({status})" for t, status in res.skipped.items()
            )
            if any(st in _ON_ITS_WAY for st in res.skipped.values()):
                done += " (one that comes up by a start is put to sleep once it runs)"
    elif step.action == "scale":
        assert step.replicas is not None
        if step.replicas < g.current_replicas:
            before = g.current_replicas
            scaler(s, clock, g.id, step.replicas, closed)
            done = f"scaled down from {before} to {step.replicas} replica(s)"
        else:
            done = (
                f"held at {g.current_replicas} replica(s) (already at or below the window's "
                f"{w.replicas}); the autoscaler leaves it alone until the window opens"
            )
    else:
        stop_group_row(s, clock, g, f"stopped {closed}")
        done = "stopped (it stays stopped when the window opens: its owner starts it)"
    out.message = f"schedule window closed ({w.describe()}): {done}; {step.save} replica(s) " \
        f"saved{reopens}"
    _event(s, now, g, EventKind.WINDOW_PAUSE, out.message, before="", after=step.action)
    return out


_ON_ITS_WAY = frozenset({T.PENDING.value, T.SCHEDULED.value, T.STARTING.value})


def _hold(s: Session, clock: Clock, g: TaskGroup, step: Hold) -> WindowOutcome | None:
    """A pause in effect: put back to sleep the replicas that came up by a start it had
    not slept (the module's docstring); anything else in effect is left as it is."""
    if step.action != "pause" or g.desired != "running":
        return None
    began = s.scalar(
        select(Event.created_at)
        .where(
            Event.group_id == g.id,
            Event.kind == EventKind.WINDOW_PAUSE.value,
            Event.from_status == "",  # the act itself, not a later re-sleep
            Event.to_status == "pause",
        )
        .order_by(Event.id.desc())
        .limit(1)
    )
    if began is None:
        return None
    began = _utc(began)
    started_by_owner = s.scalar(
        select(Event.id)
        .where(
            Event.group_id == g.id,
            Event.kind == EventKind.DESIRED.value,
            Event.to_status == "running",
            Event.created_at >= began,
        )
        .limit(1)
    )
    if started_by_owner is not None:
        return None
    running = s.scalars(
        select(Task).where(
            Task.group_id == g.id, Task.replaced_by == "", Task.status == T.RUNNING.value
        )
    ).all()
    again: list[str] = []
    w, _ = _window_of(g)
    why = f"outside its schedule window ({w.describe() if w else 'closed'}): a replica that " \
        "came up during the pause"
    for t in running:
        if not _came_up_by_a_start(s, t, began):
            continue
        try:
            sleep.sleep_task(s, clock, None, t.id, why)
        except Conflict:
            continue  # it moved meanwhile: the next round looks again
        again.append(t.id)
    if not again:
        return None
    message = f"schedule window still closed: {len(again)} replica(s) that came up by a " \
        f"start put back to sleep" + _ids(again)
    _event(s, clock.now(), g, EventKind.WINDOW_PAUSE, message, before="pause", after="pause")
    return WindowOutcome(g.id, "hold", "pause", message, again)


def _came_up_by_a_start(s: Session, t: Task, began: datetime) -> bool:
    """Running by a start (not a wake), and either on its way up when the pause began or
    the recovery loop's rebuild of a failed task."""
    came_from = s.scalar(
        select(Event.from_status)
        .where(
            Event.task_id == t.id,
            Event.kind == EventKind.TASK_STATUS.value,
            Event.to_status == T.RUNNING.value,
        )
        .order_by(Event.id.desc())
        .limit(1)
    )
    if came_from != T.STARTING.value:
        return False
    if _utc(t.created_at) <= began:
        return True
    rebuilt = s.scalar(
        select(exists().where(Task.replaced_by == t.id, Task.status == T.FAILED.value))
    )
    return bool(rebuilt)


def _restore(
    s: Session,
    clock: Clock,
    g: TaskGroup,
    step: Restore,
    scaler: Scaler,
    offline_after_s: float,
) -> WindowOutcome:
    now = clock.now()
    out = WindowOutcome(g.id, "restore", step.action, "")
    saved = g.window_saved_replicas
    if step.action == "pause":
        results = sleep.wake_group(
            s, clock, g.id, f"{step.why} (schedule window)", offline_after_s=offline_after_s
        )
        woken = [r.task_id for r in results if r.branch == "waking"]
        out.tasks = woken
        done = f"resumed: {len(woken)} task(s) woken" + _ids(woken)
        other = [f"{r.task_id}: {r.message}" for r in results if r.branch != "waking"]
        if other:
            done += "; " + "; ".join(other)
    else:
        assert step.replicas is not None
        before = g.current_replicas
        if step.replicas != before:
            scaler(s, clock, g.id, step.replicas, f"{step.why} (schedule window)")
            done = f"scaled back from {before} to {step.replicas} replica(s)"
        else:
            done = f"left at {before} replica(s)"
        if saved is not None and step.replicas != saved:
            done += f" (saved {saved}; kept within [{g.min_replicas}, {g.max_replicas}] and " \
                "never below what runs)"
    _clear(g, now)
    out.message = f"{step.why}: {done}"
    _event(s, now, g, EventKind.WINDOW_RESUME, out.message, before=step.action, after="")
    return out


def _release(s: Session, clock: Clock, g: TaskGroup, step: Release) -> WindowOutcome:
    now = clock.now()
    if step.owner_stopped:
        done = f"the service was stopped by its owner meanwhile: its {step.action} is not " \
            "undone"
    elif step.action == "stop":
        done = (
            "stopped by its window, it stays stopped: start it when you need it"
            if g.desired != "running"
            else "it was stopped by its window and has been started since"
        )
    else:
        done = f"{step.action or 'nothing'} in effect cleared"
    _clear(g, now)
    message = f"{step.why}: {done}"
    _event(s, now, g, EventKind.WINDOW_RESUME, message, before=step.action, after="")
    return WindowOutcome(g.id, "release", step.action, message)


def _failed(
    s: Session, now: datetime, g: TaskGroup, step: Step, exc: Exception
) -> WindowOutcome:
    what = {Act: "closing", Restore: "opening", Release: "opening"}.get(type(step), "window")
    action = getattr(step, "action", "")
    message = f"schedule window: the {action} at its {what} could not run: " \
        f"{getattr(exc, 'message', str(exc))}; tried again every round"
    last = s.scalar(
        select(Event.message)
        .where(Event.group_id == g.id, Event.kind.like("window.%"))
        .order_by(Event.id.desc())
        .limit(1)
    )
    if last != message:
        _event(s, now, g, EventKind.WINDOW_FAILED, message, before=g.window_action,
               after=g.window_action)
    log.warning("group %s: %s", g.id, message)
    return WindowOutcome(g.id, "failed", action, message)


# -- helpers ---------------------------------------------------------------------------


def _clear(g: TaskGroup, now: datetime) -> None:
    g.window_action, g.window_saved_replicas, g.updated_at = "", None, now


def _event(
    s: Session,
    now: datetime,
    g: TaskGroup,
    kind: EventKind,
    message: str,
    *,
    before: str = "",
    after: str = "",
) -> None:
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=kind.value, from_status=before,
            to_status=after, message=message, created_at=now,
        )
    )
    s.flush()


def _ids(ids: list[str]) -> str:
    return f" ({', '.join(ids)})" if ids else ""


def _local(at: datetime | None, w: Window) -> str:
    """``2026-01-05 08:00 CET`` in the window's zone."""
    if at is None:
        return "not within a week"
    return at.astimezone(zone(w.timezone)).strftime("%a %Y-%m-%d %H:%M %Z")


def _utc(t: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored as UTC)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
