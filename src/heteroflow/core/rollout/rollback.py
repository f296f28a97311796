"""An update that failed puts the old generation back.

**Rollback:** the attempt's candidates are retired (drained when they run, then stopped)
and draining old replicas serve again; every rank already switched (or, for recreate,
stopped) gets a candidate copied from the replica it replaced — the old generation as it
was — and is switched back the same way (one batch, no retries: a rank whose restore
fails keeps the new generation, and the message says so). Then ``failed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

from heteroflow.core.events import EventKind
from heteroflow.core.rollout.batch import (
    View,
    dispose,
    drained,
    ranks_text,
    serving_text,
    switch,
    wait,
)
from heteroflow.core.rollout.model import (
    Create,
    InFlight,
    Progress,
    RolloutPolicy,
    RolloutState,
    Step,
)
from heteroflow.core.rollout.readiness import late
from heteroflow.core.states import TaskStatus


def _restore_source(v: View, rank: int, g: int) -> str | None:
    """What rank ``rank`` is restored from: the replica its new-generation head replaced,
    or its old head when that was stopped (recreate); None when it needs no restore."""
    head = v.head(rank)
    if head is None:
        return None
    if head.generation == g:
        prev = v.predecessor(head.id)
        return prev.id if prev is not None and prev.generation != g else ""
    if head.status in (TaskStatus.STOPPED, TaskStatus.STOPPING):  # recreate stopped it
        return head.id
    return None


def rollback(
    p: Progress, v: View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> Step:
    """The next step back: pick the ranks to restore (or finish ``failed``), create their
    candidates from the replicas they replaced, wait until they run, drain the new
    generation and switch back."""
    g, back = p.generation, p.from_generation
    label = "rolling back"
    if not p.batch:
        need: list[int] = []
        lost: list[int] = []
        for rank in v.ranks:
            if rank in p.given_up:
                continue
            src = _restore_source(v, rank, g)
            if src is None:
                continue
            (need if src else lost).append(rank)
        if lost:
            p = replace(p, given_up=(*p.given_up, *lost))
        if not need:
            if p.retiring:
                return wait(p, f"{label}: {len(p.retiring)} replica(s) still draining")
            return _finish_failed(p, v)
        p = replace(p, batch=tuple(need), candidates={}, batch_since=None, drain_since=None)
    label = f"{label} ({ranks_text(p.batch)})"
    missing = [rank for rank in p.batch if rank not in p.candidates]
    if missing:
        creates = []
        for rank in missing:
            src = _restore_source(v, rank, g)
            if src:
                creates.append(Create(rank, src, restore=True))
        text = f"{label}: generation {back} starting again"
        return Step(
            progress=replace(p, batch_since=now), state=RolloutState.ROLLING_BACK,
            message=text, create=tuple(creates), events=((EventKind.ROLLOUT_BATCH, text),),
        )
    cands = {rank: v.by_id.get(tid) for rank, tid in p.candidates.items()}
    since = p.batch_since or now
    # D5: a restore whose agent says it loads (and keeps saying so) is not late
    late_by = {
        rank: why for rank, c in cands.items()
        if c is not None and (why := late(c, since, now, policy))
    }
    bad = [rank for rank, c in cands.items() if c is None or not c.live or rank in late_by]
    if bad:
        return _keep_new(p, v, now, label, bad, late_by)
    waiting = [c for c in cands.values() if c is not None and c.status != TaskStatus.RUNNING]
    if waiting:
        return wait(p, f"{label}: generation {back} starting again")
    newest = max((c.running_at or now for c in cands.values() if c is not None), default=now)
    if (now - newest).total_seconds() < policy.settle_s:
        return wait(p, f"{label}: generation {back} running; the gateways learn of it")
    serving = [
        r for rank in p.batch for r in v.current_of(rank)
        if r.status == TaskStatus.RUNNING and r.serves
    ]
    if p.drain_since is None and serving:
        text = f"{label}: generation {g} draining"
        return Step(
            progress=replace(p, drain_since=now), state=RolloutState.ROLLING_BACK,
            message=text, drain=tuple(r.id for r in serving if not r.draining),
        )
    if p.drain_since is not None and any(
        not drained(p.drain_since, in_flight.get(r.id), now, policy) for r in serving
    ):
        return wait(p, f"{label}: generation {g} draining")
    return switch(p, v, now, label, f"generation {g} drained" if serving else "restored")


def _keep_new(
    p: Progress, v: View, now: datetime, label: str, bad: list[int],
    late_by: Mapping[int, str],
) -> Step:
    """The ranks whose restore failed or did not run in time keep the new generation (no
    retries here): their candidates are put away, the rest of the batch goes on."""
    g, back = p.generation, p.from_generation
    sub = replace(p, candidates={rank: p.candidates[rank] for rank in bad})
    retiring, stop, _ = dispose(replace(sub, drain_since=None), v, now)
    rest = tuple(rank for rank in p.batch if rank not in bad)
    why = next((late_by[rank] for rank in bad if rank in late_by), "")
    text = (
        f"{label}: generation {back} did not come back on {ranks_text(bad)}"
        f"{f' ({why})' if why else ''}; they keep generation {g}"
    )
    nxt = replace(
        p, batch=rest, candidates={r: t for r, t in p.candidates.items() if r in rest},
        given_up=(*p.given_up, *bad), retiring=retiring,
    )
    return Step(
        progress=nxt, state=RolloutState.ROLLING_BACK, message=text, stop=tuple(stop),
        events=((EventKind.ROLLOUT_BATCH, text),),
    )


def _finish_failed(p: Progress, v: View) -> Step:
    text = f"{p.reason}; rolled back: {serving_text(v)}"
    if p.given_up:
        text += f" ({ranks_text(sorted(set(p.given_up)))} could not be restored)"
    return Step(
        progress=p, state=RolloutState.FAILED, message=text, finished=True,
        events=((EventKind.ROLLOUT_FAILED, f"update to generation {p.generation} failed: "
                 f"{text}"),),
    )
