"""The update going forward, batch by batch (rolling) or all at once (recreate).

**Rolling (J1)**, batch by batch over the ranks not yet on the target generation (at
most ``batch_size`` each): create the batch's candidates (the intent of the rank's
current replica with the update's changes; the placement stripped, pool ports given
back) → wait until every one runs (``ready_timeout_s``; its image is pulled on its node first, so
the new image is on every node that will run the new generation before anything drains)
→ let them run ``settle_s`` (the
gateways learn the new backends) → mark the old replicas draining (M11: no new
requests) → wait until the gateways report nothing in flight on them, no sooner than
``drain_min_s`` and no later than ``drain_timeout_s`` → switch. A batch whose candidate
fails or does not run in time is tried again (``batch_retries`` times); then the update
rolls back. An update that makes no progress — no batch switched since it started or
since the last switch — for ``progress_deadline_s`` rolls back at once, whatever retries
are left, with the reason it is stuck (a new replica the scheduler cannot place says
why in its status), so it never holds the group's update lock until ``max_hold_s``
(issue 26). A candidate whose image cannot be pulled (not found, unauthorised: H7) fails
the update at once — no retry can change it — with nothing drained.

**A gang (issue 32)** — the stages of a ``pipeline`` group — is replaced as a unit:
every stage in one batch (rolling: the new gang starts whole beside the old, placed all
or nothing, is switched in once every stage runs — its rank 0 then serves — and the old
gang stops; recreate: the old gang stops whole, then the new one starts whole). Only
stages that serve (``Replica.serves``: rank 0) drain; a headless one has no request to
finish. A failed attempt is not retried (``Progress.gang``): the update rolls back at
once and the old gang, never stopped by a rolling update, serves on.

**Recreate (J2):** make the new image present on the node of every old replica that
has one (``prepull``: each replica's agent pulls it and says so, H7), then drain every
old replica, stop them all, create every candidate, switch them all once they all run
(retries and rollback as above). An image that cannot be pulled (not found,
unauthorised) on any of those nodes, or a pre-pull not done within
``progress_deadline_s``, fails the update before anything drained: the old generation
serves on. Without it a new image that cannot be pulled, or pulls for ten minutes,
would leave the service with nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime

from heteroflow.core.events import EventKind
from heteroflow.core.rollout.batch import (
    View,
    dispose,
    drained,
    first_line,
    ranks_text,
    serving_text,
    state_of,
    switch,
    wait,
)
from heteroflow.core.rollout.model import (
    Create,
    InFlight,
    Progress,
    Replica,
    RolloutPolicy,
    RolloutState,
    Step,
    Strategy,
)
from heteroflow.core.rollout.readiness import late, progressing
from heteroflow.core.states import TaskStatus


def batches_total(ranks: int, p: Progress) -> int:
    if p.strategy == Strategy.RECREATE or p.rolling_back:
        return 1
    return max(1, math.ceil(ranks / max(1, p.batch_size)))


def forward(
    p: Progress, v: View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> Step:
    """The next step forward: pick the next batch (or finish), create its candidates,
    wait until they run (a batch that fails or stalls is retried or rolls back), then
    drain its old replicas and switch."""
    g = p.generation
    if p.progress_at is None:  # a rollout written before the deadline existed
        p = replace(p, progress_at=now)
    if p.strategy == Strategy.RECREATE and not p.old_stopped:
        if p.prepull_image and not p.prepulled:
            return _recreate_prepull(p, v, now, policy)
        return _recreate_stop_old(p, v, now, policy, in_flight)
    done = {rank for rank in v.ranks if all(r.generation == g for r in v.current_of(rank))}
    total = batches_total(len(v.ranks), p)
    if not p.batch:
        todo = [rank for rank in v.ranks if rank not in done]
        if not todo:
            if p.retiring:
                return wait(p, f"finishing: {len(p.retiring)} replica(s) still draining")
            text = f"generation {g} serves on every replica ({len(v.ranks)})"
            return Step(
                progress=p, state=RolloutState.DONE, message=text, finished=True,
                events=((EventKind.ROLLOUT_DONE, f"update to generation {g} done: {text}"),),
            )
        size = len(todo) if p.strategy == Strategy.RECREATE else max(1, p.batch_size)
        p = replace(
            p, batch=tuple(todo[:size]), candidates={}, attempt=1, batch_since=None,
            drain_since=None,
        )
    label = f"batch {min(p.batches_done + 1, total)}/{total} ({ranks_text(p.batch)})"
    missing = [rank for rank in p.batch if rank not in p.candidates]
    if missing:
        creates = []
        for rank in missing:
            head = v.head(rank)
            if head is not None:
                creates.append(Create(rank, head.id))
        text = f"{label}: new generation starting (attempt {p.attempt} of {policy.attempts})"
        return Step(
            progress=replace(p, batch_since=now),
            state=state_of(p),
            message=text,
            create=tuple(creates),
            events=((EventKind.ROLLOUT_BATCH, text),),
        )
    cands = {rank: v.by_id.get(tid) for rank, tid in p.candidates.items()}
    failed = {
        rank: c for rank, c in cands.items() if c is None or not c.live
    }
    waiting = [rank for rank, c in cands.items() if c is not None and c.live
               and c.status != TaskStatus.RUNNING]
    since = p.batch_since or now
    # D5: a candidate whose agent says it loads (and keeps saying so) is not late
    late_by = {
        rank: why for rank in waiting
        if (c := cands[rank]) is not None and (why := late(c, since, now, policy))
    }
    quiet = [rank for rank in waiting if not _loads(cands[rank], now, policy)]
    stalled = bool(quiet) and _stalled(p, now, policy)
    if failed or late_by or stalled:
        why = _why_failed(p, cands, failed, late_by, quiet, policy, stalled=stalled)
        # H7: an image that cannot be pulled fails the update at once, before any old
        # replica of the batch drained (they drain only once every candidate runs)
        unpullable = any(c is not None and c.unpullable for c in failed.values())
        if unpullable:
            why = f"{why} (not retried: the new image cannot be pulled)"
        return _batch_failed(p, v, now, policy, label, why, retry=not (stalled or unpullable))
    if waiting:
        running = len(p.batch) - len(waiting)
        extra = f" ({running} of {len(p.batch)} running)" if len(p.batch) > 1 else ""
        loading = [c for rank in waiting if _loads(c := cands[rank], now, policy)]
        if loading and loading[0] is not None:  # D5: what its agent last said of its load
            extra += f"; {loading[0].id}: {first_line(loading[0].message)[:200]}"
        return wait(
            p, f"{label}: new generation starting (attempt {p.attempt} of "
            f"{policy.attempts}){extra}",
        )
    return _switch_when_drained(p, v, cands, now, policy, in_flight, label)


def _loads(c: Replica | None, now: datetime, policy: RolloutPolicy) -> bool:
    return c is not None and progressing(c, now, policy)


def _why_failed(
    p: Progress,
    cands: Mapping[int, Replica | None],
    failed: Mapping[int, Replica | None],
    late_by: Mapping[int, str],
    quiet: Sequence[int],
    policy: RolloutPolicy,
    *,
    stalled: bool,
) -> str:
    """Why the batch's attempt failed: its first candidate that is gone or ended, else the
    first one late (past ``ready_timeout_s`` and not loading, or its load went quiet), else
    the first one not loading when the update stalled."""
    if failed:
        rank, c = next(iter(sorted(failed.items())))
        return (
            f"its new replica {p.candidates[rank]} (rank {rank}) is gone" if c is None
            else f"its new replica {c.id} (rank {rank}) {c.status.value}: "
            f"{first_line(c.message) or 'no reason recorded'}"
        )
    rank = min(late_by) if late_by and not stalled else min(quiet)
    c = cands[rank]
    assert c is not None
    still = (
        f"{c.id} (rank {c.rank}) is still {c.status.value}: "
        f"{first_line(c.message) or 'no reason recorded'}"
    )
    if stalled:
        return f"no progress for {policy.progress_deadline_s:g} s: its new replica {still}"
    return (
        f"its new replica(s) ({ranks_text(sorted(late_by))}) were {late_by[rank]}; {still}"
    )


def _switch_when_drained(
    p: Progress,
    v: View,
    cands: Mapping[int, Replica | None],
    now: datetime,
    policy: RolloutPolicy,
    in_flight: InFlight,
    label: str,
) -> Step:
    """Every candidate of the batch runs: switch (recreate: at once), once they ran
    ``settle_s`` and the batch's old replicas that serve drained."""
    cand_list = [c for c in cands.values() if c is not None]
    if p.strategy == Strategy.RECREATE:
        return switch(p, v, now, label, "new generation running")
    newest = max((c.running_at or now for c in cand_list), default=now)
    if (now - newest).total_seconds() < policy.settle_s:
        return wait(p, f"{label}: new generation running; the gateways learn of it")
    olds = [r for rank in p.batch for r in v.current_of(rank) if r.generation != p.generation]
    serving = [r for r in olds if r.status == TaskStatus.RUNNING and r.serves]
    if not serving:  # nothing to drain (failed, never placed, asleep): switch now
        return switch(p, v, now, label, "new generation running")
    if p.drain_since is None:
        text = f"{label}: new generation running; old generation draining"
        drain = tuple(r.id for r in serving if not r.draining)
        return Step(
            progress=replace(p, drain_since=now), state=state_of(p), message=text, drain=drain,
            events=((EventKind.ROLLOUT_BATCH, text),),
        )
    busy = [r for r in serving if not drained(p.drain_since, in_flight.get(r.id), now, policy)]
    if busy:
        return wait(p, f"{label}: new generation running; old generation draining")
    return switch(p, v, now, label, "old generation drained")


def _stalled(p: Progress, now: datetime, policy: RolloutPolicy) -> bool:
    """No batch switched for ``progress_deadline_s`` (since the start or the last one)."""
    since = p.progress_at or now
    return (now - since).total_seconds() >= policy.progress_deadline_s


def _batch_failed(
    p: Progress, v: View, now: datetime, policy: RolloutPolicy, label: str, why: str,
    *, retry: bool = True,
) -> Step:
    """The batch's attempt failed: tried again while attempts are left (and ``retry``),
    else the update rolls back."""
    retiring, stop, undrain = dispose(p, v, now)
    retry = retry and not p.gang  # a gang's attempt is not retried: see Progress.gang
    if retry and p.attempt < policy.attempts:
        text = (
            f"{label}: attempt {p.attempt} of {policy.attempts} failed ({why}); trying again"
        )
        nxt = replace(
            p, candidates={}, attempt=p.attempt + 1, batch_since=None, drain_since=None,
            retiring=retiring,
        )
        return Step(
            progress=nxt, state=state_of(p), message=text, stop=tuple(stop),
            undrain=tuple(undrain), events=((EventKind.ROLLOUT_RETRY, text),),
        )
    reason = (
        f"{label} failed {policy.attempts} times; last: {why}" if retry else f"{label}: {why}"
    )
    nxt = replace(
        p, rolling_back=True, reason=reason, batch=(), candidates={}, attempt=1,
        batch_since=None, drain_since=None, retiring=retiring, batches_done=0,
    )
    text = f"rolling back to generation {p.from_generation}: {reason}"
    return Step(
        progress=nxt, state=RolloutState.ROLLING_BACK, message=text, stop=tuple(stop),
        undrain=tuple(undrain), events=((EventKind.ROLLOUT_ROLLBACK, text),),
    )


def _recreate_prepull(p: Progress, v: View, now: datetime, policy: RolloutPolicy) -> Step:
    """Recreate's first phase: the new image on the node of every old replica placed on
    one (pending ones have none), asked of their agents while ``prepull_image`` is set and
    ``prepulled`` is not; their answers come back as the replicas' ``prepull``."""
    g = p.generation
    if p.batch_since is None:
        p = replace(p, batch_since=now)
    since = p.batch_since or now
    olds = [
        r for r in v.current
        if r.live and r.generation != g and r.status != TaskStatus.PENDING
    ]
    image = p.prepull_image
    refused = [r for r in olds if r.prepull == "unavailable"]
    waiting = [r for r in olds if r.prepull != "pulled"]
    failed = [r for r in waiting if r.prepull == "failed"]
    late = bool(waiting) and (now - since).total_seconds() >= policy.progress_deadline_s
    if refused or late:
        r = (refused or failed or waiting)[0]
        said = first_line(r.prepull_message) or "no word from its agent yet"
        why = (
            f"the new image {image} cannot be pulled on the node of {r.id}: {said}"
            if refused else
            f"the new image {image} was not on the nodes of every old replica within "
            f"{policy.progress_deadline_s:g} s ({len(waiting)} of {len(olds)} not yet; "
            f"{r.id}: {said})"
        )
        text = f"recreate: {why}; nothing was stopped: {serving_text(v)}"
        return Step(
            progress=replace(p, batch_since=None), state=RolloutState.FAILED, message=text,
            finished=True,
            events=((EventKind.ROLLOUT_FAILED, f"update to generation {g} failed: {text}"),),
        )
    if waiting:
        extra = (
            f"; last failure on {failed[0].id}: {first_line(failed[0].prepull_message)}"
            if failed else ""
        )
        return wait(
            p, f"recreate: new image {image} being pulled on the old replicas' nodes "
            f"({len(olds) - len(waiting)} of {len(olds)} ready){extra}",
        )
    text = (
        f"recreate: new image {image} present on the nodes of every old replica "
        f"({len(olds)}); the old generation stops next"
    )
    return Step(
        progress=replace(p, prepulled=True, batch_since=None), state=state_of(p),
        message=text, events=((EventKind.ROLLOUT_BATCH, text),),
    )


def _recreate_stop_old(
    p: Progress, v: View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> Step:
    olds = [r for r in v.current if r.live and r.generation != p.generation]
    serving = [r for r in olds if r.status == TaskStatus.RUNNING and r.serves] if p.drain else []
    if serving and p.drain_since is None:
        text = f"recreate: old generation draining ({len(serving)} replica(s))"
        return Step(
            progress=replace(p, drain_since=now), state=state_of(p), message=text,
            drain=tuple(r.id for r in serving if not r.draining),
            events=((EventKind.ROLLOUT_BATCH, text),),
        )
    if serving and p.drain_since is not None and not all(
        drained(p.drain_since, in_flight.get(r.id), now, policy) for r in serving
    ):
        return wait(p, f"recreate: old generation draining ({len(serving)} replica(s))")
    text = f"recreate: old generation stopping ({len(olds)} replica(s))"
    return Step(
        progress=replace(p, old_stopped=True, drain_since=None), state=state_of(p),
        message=text, stop=tuple(r.id for r in olds),
        events=((EventKind.ROLLOUT_BATCH, text),),
    )
