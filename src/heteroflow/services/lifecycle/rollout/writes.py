"""Write one step of a rollout: create its candidates, drain and undrain, switch ranks,
stop, record its events and progress (in the caller's transaction)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.rollout import CANDIDATE, Progress, Promote, Step, progress_to_json
from heteroflow.db.tables import Event, Task, TaskGroup
from heteroflow.services.lifecycle import draining
from heteroflow.services.lifecycle.replicas import new_replica
from heteroflow.services.lifecycle.task_groups import ask_stop
from heteroflow.services.lifecycle.transitions import refresh_group_status

log = logging.getLogger(__name__)


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
