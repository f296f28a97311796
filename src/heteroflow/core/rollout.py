"""Rolling update and recreate (J1-J4) as a pure state machine: facts in, one step out.

``services/rollout.py`` reads a group's replicas and its rollout's progress (the JSON in
``task_groups.rollout_spec``), calls ``step`` and writes what it says in one transaction
fenced by the rollout's execution lease; the next round reads everything again
(level-triggered), so a round that was lost or refused is simply made again. Nothing
here reads a clock or a database.

**Candidates.** A rollout's new replicas are *candidates*: ``tasks.replaced_by`` holds
``CANDIDATE`` (not a task id), so they are not current — the group's derived status,
its reads and the recovery loop see only the replicas that serve — but the routing
snapshot routes every ``running`` task, so a candidate takes requests as soon as its
first health check passed. A batch *switches* a rank (``Promote``) in one transaction:
the old replica's ``replaced_by`` becomes the candidate's id, the candidate's becomes
"" (current), and the old replica is asked to stop.

**Rolling (J1)**, batch by batch over the ranks not yet on the target generation (at
most ``batch_size`` each): create the batch's candidates (the intent of the rank's
current replica with the update's changes; the placement stripped, pool ports given
back) → wait until every one runs (``ready_timeout_s``) → let them run ``settle_s`` (the
gateways learn the new backends) → mark the old replicas draining (M11: no new
requests) → wait until the gateways report nothing in flight on them, no sooner than
``drain_min_s`` and no later than ``drain_timeout_s`` → switch. A batch whose candidate
fails or does not run in time is tried again (``batch_retries`` times); then the update
rolls back. An update that makes no progress — no batch switched since it started or
since the last switch — for ``progress_deadline_s`` rolls back at once, whatever retries
are left, with the reason it is stuck (a new replica the scheduler cannot place says
why in its status), so it never holds the group's update lock until ``max_hold_s``
(issue 26).

**Recreate (J2):** drain every old replica, stop them all, create every candidate,
switch them all once they all run (retries and rollback as above).

**Rollback:** the attempt's candidates are retired (drained when they run, then stopped)
and draining old replicas serve again; every rank already switched (or, for recreate,
stopped) gets a candidate copied from the replica it replaced — the old generation as it
was — and is switched back the same way (one batch, no retries: a rank whose restore
fails keeps the new generation, and the message says so). Then ``failed``.

**Abandon (J4):** when the holder lost its lease (the expiry scan), held it too long
(``max_hold_s``) or the service was stopped or deleted, ``abandon`` leaves the group as it
serves: candidates that were never switched are stopped (a running one is drained
first; the scan stops it once drained), old replicas it drained serve again, ranks
already switched keep the new generation.

Retiring: a task the rollout stops while it may hold requests (a running candidate of a
failed attempt) is drained first and stopped once drained (``Progress.retiring``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from heteroflow.core.events import EventKind
from heteroflow.core.states import TERMINAL, TaskStatus, WireEnum

# ``tasks.replaced_by`` of a rollout's new replica until its batch switches it in
CANDIDATE = "candidate"


class RolloutState(WireEnum):
    """``task_groups.rolling_update_state`` (NULL: never updated)."""

    ROLLING = "rolling"  # a rolling update runs
    RECREATING = "recreating"  # a recreate runs
    ROLLING_BACK = "rolling_back"  # a failed update puts the old generation back
    DONE = "done"  # the last update finished: every replica runs its generation
    FAILED = "failed"  # the last update failed (rolled back, or abandoned); resubmit it


ACTIVE = frozenset({RolloutState.ROLLING, RolloutState.RECREATING, RolloutState.ROLLING_BACK})


class Strategy(WireEnum):
    ROLLING = "rolling"
    RECREATE = "recreate"


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    ready_timeout_s: float = 300.0  # a batch's candidates run within this, else it failed
    settle_s: float = 2.0  # candidates run this long before the old replicas drain
    drain_min_s: float = 2.0  # a draining replica stops no sooner (every gateway saw it)
    drain_timeout_s: float = 30.0  # ... and no later, requests in flight or not
    batch_retries: int = 3  # a failed batch is tried again this many times
    lease_ttl_s: float = 60.0  # the execution lease (J4)
    renew_s: float = 15.0  # renewed this often
    max_hold_s: float = 960.0  # held at most this long (16 min)
    progress_deadline_s: float = 600.0  # no batch switched this long: it fails, rolls back

    @property
    def attempts(self) -> int:
        return 1 + self.batch_retries


@dataclass(frozen=True, slots=True)
class Replica:
    """One task of the group as the machine sees it."""

    id: str
    rank: int
    generation: int
    status: TaskStatus
    replaced_by: str  # "" = current; CANDIDATE = a rollout's new replica; else a task id
    draining: bool = False
    running_at: datetime | None = None
    message: str = ""  # its status message (why it failed)

    @property
    def current(self) -> bool:
        return self.replaced_by == ""

    @property
    def candidate(self) -> bool:
        return self.replaced_by == CANDIDATE

    @property
    def live(self) -> bool:
        """Not ended and not on its way out."""
        return self.status not in TERMINAL and self.status != TaskStatus.STOPPING


@dataclass(frozen=True, slots=True)
class Progress:
    """What a rollout remembers between rounds (``task_groups.rollout_spec``, with the
    update's changes, which only the service reads)."""

    strategy: Strategy
    generation: int  # the generation it rolls to
    from_generation: int
    batch_size: int = 1
    rolling_back: bool = False
    reason: str = ""  # why it rolls back
    batch: tuple[int, ...] = ()  # the ranks in progress
    candidates: Mapping[int, str] = field(default_factory=dict)  # rank -> task id
    attempt: int = 1
    batch_since: datetime | None = None  # this attempt's candidates were created
    drain_since: datetime | None = None  # the batch's old replicas were marked draining
    old_stopped: bool = False  # recreate: the old generation was told to stop
    drain: bool = True  # old replicas drain before they stop (False: nothing routes to them)
    given_up: tuple[int, ...] = ()  # rollback: ranks whose restore failed
    retiring: Mapping[str, datetime] = field(default_factory=dict)  # task -> draining since
    batches_done: int = 0
    progress_at: datetime | None = None  # it started, or a batch last switched


@dataclass(frozen=True, slots=True)
class Create:
    """A candidate for ``rank``: a copy of task ``source`` — with the update's changes
    (forward) or as it was (``restore``: the rollback)."""

    rank: int
    source: str
    restore: bool = False


@dataclass(frozen=True, slots=True)
class Promote:
    """Switch ``rank`` to ``candidate``; ``olds`` (its current replicas) stop."""

    rank: int
    candidate: str
    olds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Step:
    progress: Progress
    state: RolloutState
    message: str  # rolling_update_message: where it stands, for people
    create: tuple[Create, ...] = ()
    drain: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    promote: tuple[Promote, ...] = ()
    events: tuple[tuple[EventKind, str], ...] = ()
    finished: bool = False  # the lease is released (state DONE or FAILED)


# task id -> (requests in flight on it, as of when) from the gateways' reports
InFlight = Mapping[str, tuple[int, datetime]]


def drained(
    since: datetime, report: tuple[int, datetime] | None, now: datetime, policy: RolloutPolicy
) -> bool:
    """May a replica draining since ``since`` stop now? Not before ``drain_min_s`` (every
    gateway has seen the mark by then); then once a report made after that says nothing
    is in flight on it; at ``drain_timeout_s`` in any case."""
    waited = (now - since).total_seconds()
    if waited >= policy.drain_timeout_s:
        return True
    if waited < policy.drain_min_s or report is None:
        return False
    count, as_of = report
    return count == 0 and as_of >= since + timedelta(seconds=policy.drain_min_s)


def batches_total(ranks: int, p: Progress) -> int:
    if p.strategy == Strategy.RECREATE or p.rolling_back:
        return 1
    return max(1, math.ceil(ranks / max(1, p.batch_size)))


def first_line(text: str) -> str:
    """A status message in one line: its first line, and when that announces more
    ("...; last output:") the line of the rest where the engine says why (the last one
    that mentions an error, else the last one)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return ""
    head, rest = lines[0], lines[1:]
    if head.endswith(":") and rest:
        errors = [ln for ln in rest if "error" in ln.lower()]
        head = f"{head} {(errors or rest)[-1][:200]}"
    return head


class _View:
    """The replicas indexed the ways the machine asks about them."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.by_id = {r.id: r for r in replicas}
        self.current = [r for r in replicas if r.current]
        self.ranks = sorted({r.rank for r in self.current})
        self.replicas = list(replicas)

    def current_of(self, rank: int) -> list[Replica]:
        return [r for r in self.current if r.rank == rank]

    def head(self, rank: int) -> Replica | None:
        """The rank's current replica (the live one when several are current)."""
        cur = self.current_of(rank)
        live = [r for r in cur if r.live]
        pick = live or cur
        return pick[-1] if pick else None

    def predecessor(self, task_id: str) -> Replica | None:
        """The task ``task_id`` replaced (its ``replaced_by`` names it)."""
        return next((r for r in self.replicas if r.replaced_by == task_id), None)


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _retire(
    p: Progress, v: _View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> tuple[Progress, list[str]]:
    """Stop the retiring tasks that are drained (or no longer run); keep the others."""
    keep: dict[str, datetime] = {}
    stop: list[str] = []
    for tid, since in p.retiring.items():
        r = v.by_id.get(tid)
        if r is None or not r.live:
            continue
        if r.status != TaskStatus.RUNNING or drained(since, in_flight.get(tid), now, policy):
            stop.append(tid)
        else:
            keep[tid] = since
    return replace(p, retiring=keep), stop


def _dispose(
    p: Progress, v: _View, now: datetime
) -> tuple[dict[str, datetime], list[str], list[str]]:
    """This attempt's candidates: running ones retire (drained first), the others stop;
    the batch's current replicas the rollout drained serve again.
    Returns (retiring, stop now, undrain)."""
    retiring = dict(p.retiring)
    stop: list[str] = []
    for tid in p.candidates.values():
        r = v.by_id.get(tid)
        if r is None or not r.live:
            continue
        if r.status == TaskStatus.RUNNING:
            retiring.setdefault(tid, now)
        else:
            stop.append(tid)
    undrain = []
    if p.drain_since is not None:
        undrain = [r.id for rank in p.batch for r in v.current_of(rank) if r.draining and r.live]
    return retiring, stop, undrain


def step(
    p: Progress,
    replicas: Sequence[Replica],
    now: datetime,
    policy: RolloutPolicy,
    in_flight: InFlight | None = None,
) -> Step:
    """The next step of a rollout holding its lease."""
    v = _View(replicas)
    p, stop = _retire(p, v, now, policy, in_flight or {})
    out = _rollback(p, v, now, policy, in_flight or {}) if p.rolling_back else _forward(
        p, v, now, policy, in_flight or {}
    )
    if stop:
        out = replace(out, stop=(*stop, *out.stop))
    return out


def _state(p: Progress) -> RolloutState:
    if p.rolling_back:
        return RolloutState.ROLLING_BACK
    return RolloutState.RECREATING if p.strategy == Strategy.RECREATE else RolloutState.ROLLING


def _wait(p: Progress, message: str) -> Step:
    return Step(progress=p, state=_state(p), message=message)


def _forward(
    p: Progress, v: _View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> Step:
    g = p.generation
    if p.progress_at is None:  # a rollout written before the deadline existed
        p = replace(p, progress_at=now)
    if p.strategy == Strategy.RECREATE and not p.old_stopped:
        return _recreate_stop_old(p, v, now, policy, in_flight)
    done = {rank for rank in v.ranks if all(r.generation == g for r in v.current_of(rank))}
    total = batches_total(len(v.ranks), p)
    if not p.batch:
        todo = [rank for rank in v.ranks if rank not in done]
        if not todo:
            if p.retiring:
                return _wait(p, f"finishing: {len(p.retiring)} replica(s) still draining")
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
    label = f"batch {min(p.batches_done + 1, total)}/{total} ({_ranks_text(p.batch)})"
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
            state=_state(p),
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
    late = bool(not failed and waiting) and (
        (now - since).total_seconds() >= policy.ready_timeout_s
    )
    stalled = bool(waiting) and _stalled(p, now, policy)
    if failed or late or stalled:
        if failed:
            rank, c = next(iter(sorted(failed.items())))
            why = (
                f"its new replica {p.candidates[rank]} (rank {rank}) is gone" if c is None
                else f"its new replica {c.id} (rank {rank}) {c.status.value}: "
                f"{first_line(c.message) or 'no reason recorded'}"
            )
        else:
            c = cands[waiting[0]]
            assert c is not None
            still = (
                f"{c.id} (rank {c.rank}) is still {c.status.value}: "
                f"{first_line(c.message) or 'no reason recorded'}"
            )
            why = (
                f"no progress for {policy.progress_deadline_s:g} s: its new replica {still}"
                if stalled else
                f"its new replica(s) ({_ranks_text(waiting)}) were not running and healthy "
                f"within {policy.ready_timeout_s:g} s; {still}"
            )
        return _batch_failed(p, v, now, policy, label, why, retry=not stalled)
    if waiting:
        running = len(p.batch) - len(waiting)
        extra = f" ({running} of {len(p.batch)} running)" if len(p.batch) > 1 else ""
        return _wait(
            p, f"{label}: new generation starting (attempt {p.attempt} of "
            f"{policy.attempts}){extra}",
        )
    # every candidate of the batch runs
    cand_list = [c for c in cands.values() if c is not None]
    if p.strategy == Strategy.RECREATE:
        return _switch(p, v, now, label, "new generation running")
    newest = max((c.running_at or now for c in cand_list), default=now)
    if (now - newest).total_seconds() < policy.settle_s:
        return _wait(p, f"{label}: new generation running; the gateways learn of it")
    olds = [r for rank in p.batch for r in v.current_of(rank) if r.generation != g]
    serving = [r for r in olds if r.status == TaskStatus.RUNNING]
    if not serving:  # nothing to drain (failed, never placed, asleep): switch now
        return _switch(p, v, now, label, "new generation running")
    if p.drain_since is None:
        text = f"{label}: new generation running; old generation draining"
        drain = tuple(r.id for r in serving if not r.draining)
        return Step(
            progress=replace(p, drain_since=now), state=_state(p), message=text, drain=drain,
            events=((EventKind.ROLLOUT_BATCH, text),),
        )
    busy = [r for r in serving if not drained(p.drain_since, in_flight.get(r.id), now, policy)]
    if busy:
        return _wait(p, f"{label}: new generation running; old generation draining")
    return _switch(p, v, now, label, "old generation drained")


def _stalled(p: Progress, now: datetime, policy: RolloutPolicy) -> bool:
    """No batch switched for ``progress_deadline_s`` (since the start or the last one)."""
    since = p.progress_at or now
    return (now - since).total_seconds() >= policy.progress_deadline_s


def _switch(p: Progress, v: _View, now: datetime, label: str, why: str) -> Step:
    promote = tuple(
        Promote(rank, p.candidates[rank], tuple(r.id for r in v.current_of(rank)))
        for rank in p.batch
    )
    g = p.generation if not p.rolling_back else p.from_generation
    text = f"{label}: {why}; switched to generation {g}"
    nxt = replace(
        p, batch=(), candidates={}, attempt=1, batch_since=None, drain_since=None,
        batches_done=p.batches_done + 1, progress_at=now,
    )
    return Step(
        progress=nxt, state=_state(p), message=text, promote=promote,
        events=((EventKind.ROLLOUT_BATCH, text),),
    )


def _batch_failed(
    p: Progress, v: _View, now: datetime, policy: RolloutPolicy, label: str, why: str,
    *, retry: bool = True,
) -> Step:
    """The batch's attempt failed: tried again while attempts are left (and ``retry``),
    else the update rolls back."""
    retiring, stop, undrain = _dispose(p, v, now)
    if retry and p.attempt < policy.attempts:
        text = (
            f"{label}: attempt {p.attempt} of {policy.attempts} failed ({why}); trying again"
        )
        nxt = replace(
            p, candidates={}, attempt=p.attempt + 1, batch_since=None, drain_since=None,
            retiring=retiring,
        )
        return Step(
            progress=nxt, state=_state(p), message=text, stop=tuple(stop),
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


def _recreate_stop_old(
    p: Progress, v: _View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> Step:
    olds = [r for r in v.current if r.live and r.generation != p.generation]
    serving = [r for r in olds if r.status == TaskStatus.RUNNING] if p.drain else []
    if serving and p.drain_since is None:
        text = f"recreate: old generation draining ({len(serving)} replica(s))"
        return Step(
            progress=replace(p, drain_since=now), state=_state(p), message=text,
            drain=tuple(r.id for r in serving if not r.draining),
            events=((EventKind.ROLLOUT_BATCH, text),),
        )
    if serving and p.drain_since is not None and not all(
        drained(p.drain_since, in_flight.get(r.id), now, policy) for r in serving
    ):
        return _wait(p, f"recreate: old generation draining ({len(serving)} replica(s))")
    text = f"recreate: old generation stopping ({len(olds)} replica(s))"
    return Step(
        progress=replace(p, old_stopped=True, drain_since=None), state=_state(p),
        message=text, stop=tuple(r.id for r in olds),
        events=((EventKind.ROLLOUT_BATCH, text),),
    )


def _restore_source(v: _View, rank: int, g: int) -> str | None:
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


def _rollback(
    p: Progress, v: _View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
) -> Step:
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
                return _wait(p, f"{label}: {len(p.retiring)} replica(s) still draining")
            return _finish_failed(p, v)
        p = replace(p, batch=tuple(need), candidates={}, batch_since=None, drain_since=None)
    label = f"{label} ({_ranks_text(p.batch)})"
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
    timed_out = (now - since).total_seconds() >= policy.ready_timeout_s
    bad = [
        rank for rank, c in cands.items()
        if c is None or not c.live or (timed_out and c.status != TaskStatus.RUNNING)
    ]
    if bad:
        # no retries here: those ranks keep the new generation
        sub = replace(p, candidates={rank: p.candidates[rank] for rank in bad})
        retiring, stop, _ = _dispose(replace(sub, drain_since=None), v, now)
        rest = tuple(rank for rank in p.batch if rank not in bad)
        text = (
            f"{label}: generation {back} did not come back on {_ranks_text(bad)}; "
            f"they keep generation {g}"
        )
        nxt = replace(
            p, batch=rest, candidates={r: t for r, t in p.candidates.items() if r in rest},
            given_up=(*p.given_up, *bad), retiring=retiring,
        )
        return Step(
            progress=nxt, state=RolloutState.ROLLING_BACK, message=text, stop=tuple(stop),
            events=((EventKind.ROLLOUT_BATCH, text),),
        )
    waiting = [c for c in cands.values() if c is not None and c.status != TaskStatus.RUNNING]
    if waiting:
        return _wait(p, f"{label}: generation {back} starting again")
    newest = max((c.running_at or now for c in cands.values() if c is not None), default=now)
    if (now - newest).total_seconds() < policy.settle_s:
        return _wait(p, f"{label}: generation {back} running; the gateways learn of it")
    serving = [
        r for rank in p.batch for r in v.current_of(rank) if r.status == TaskStatus.RUNNING
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
        return _wait(p, f"{label}: generation {g} draining")
    return _switch(p, v, now, label, f"generation {g} drained" if serving else "restored")


def _serving_text(v: _View) -> str:
    gens: dict[int, list[int]] = {}
    for rank in v.ranks:
        head = v.head(rank)
        if head is not None:
            gens.setdefault(head.generation, []).append(rank)
    if len(gens) == 1:
        (gen,) = gens
        return f"generation {gen} serves"
    return "; ".join(f"generation {gen} on {_ranks_text(rs)}" for gen, rs in sorted(gens.items()))


def _finish_failed(p: Progress, v: _View) -> Step:
    text = f"{p.reason}; rolled back: {_serving_text(v)}"
    if p.given_up:
        text += f" ({_ranks_text(sorted(set(p.given_up)))} could not be restored)"
    return Step(
        progress=p, state=RolloutState.FAILED, message=text, finished=True,
        events=((EventKind.ROLLOUT_FAILED, f"update to generation {p.generation} failed: "
                 f"{text}"),),
    )


def abandon(p: Progress, replicas: Sequence[Replica], reason: str, *, hard: bool) -> Step:
    """Give the rollout up where it stands (lease expired or held too long, the service
    stopped or deleted): candidates never switched in are stopped — with ``hard`` at once,
    else a running one is drained first (``orphans`` stops it once drained) —, old
    replicas it drained serve again, ranks already switched keep the new generation."""
    v = _View(replicas)
    stop: list[str] = []
    drain: list[str] = []
    ids = {*p.candidates.values(), *p.retiring}
    for tid in sorted(ids):
        r = v.by_id.get(tid)
        if r is None or not r.live:
            continue
        if r.status == TaskStatus.RUNNING and not hard:
            if not r.draining:
                drain.append(tid)
        else:
            stop.append(tid)
    undrain: list[str] = []
    if p.drain_since is not None:
        ranks = v.ranks if (p.strategy == Strategy.RECREATE and not p.old_stopped) else p.batch
        undrain = [r.id for rank in ranks for r in v.current_of(rank) if r.draining and r.live]
    text = f"{reason}; {_serving_text(v)}" if v.ranks else reason
    return Step(
        progress=replace(p, batch=(), candidates={}, retiring={}),
        state=RolloutState.FAILED,
        message=text,
        stop=tuple(stop),
        drain=tuple(drain),
        undrain=tuple(undrain),
        events=((EventKind.ROLLOUT_FAILED,
                 f"update to generation {p.generation} failed: {text}"),),
        finished=True,
    )


def orphans(
    replicas: Sequence[Replica],
    owned: set[str],
    drained_since: Callable[[str], datetime | None],
    now: datetime,
    policy: RolloutPolicy,
) -> tuple[list[str], list[str]]:
    """Live candidates no running rollout owns (``owned``: the ids it knows): those not
    running stop; running ones drain, and stop once drained ``drain_timeout_s`` (since
    their last drain mark, ``drained_since``). Returns (stop, drain)."""
    stop: list[str] = []
    drain: list[str] = []
    for r in replicas:
        if not r.candidate or not r.live or r.id in owned:
            continue
        if r.status != TaskStatus.RUNNING:
            stop.append(r.id)
        elif not r.draining:
            drain.append(r.id)
        else:
            since = drained_since(r.id)
            if since is None or (now - since).total_seconds() >= policy.drain_timeout_s:
                stop.append(r.id)
    return stop, drain


def lease_action(
    started_at: datetime | None, expires_at: datetime | None, now: datetime,
    policy: RolloutPolicy,
) -> str:
    """What the holder does with its lease this round: "hold" (nothing), "renew" (due:
    at most ``lease_ttl_s - renew_s`` left), "expired" (it lapsed: not ours any more) or
    "too_long" (held ``max_hold_s``: give the rollout up)."""
    if expires_at is None or expires_at < now:
        return "expired"
    if started_at is not None and (now - started_at).total_seconds() >= policy.max_hold_s:
        return "too_long"
    left = (expires_at - now).total_seconds()
    return "renew" if left <= policy.lease_ttl_s - policy.renew_s else "hold"


# ---- the progress as JSON (task_groups.rollout_spec) ------------------------------------


def _dt(v: Any) -> datetime | None:
    return datetime.fromisoformat(v) if isinstance(v, str) and v else None


def _iso(v: datetime | None) -> str | None:
    return v.isoformat() if v is not None else None


def progress_to_json(p: Progress) -> dict[str, Any]:
    return {
        "strategy": p.strategy.value,
        "generation": p.generation,
        "from_generation": p.from_generation,
        "batch_size": p.batch_size,
        "rolling_back": p.rolling_back,
        "reason": p.reason,
        "batch": list(p.batch),
        "candidates": {str(k): v for k, v in p.candidates.items()},
        "attempt": p.attempt,
        "batch_since": _iso(p.batch_since),
        "drain_since": _iso(p.drain_since),
        "old_stopped": p.old_stopped,
        "drain": p.drain,
        "given_up": list(p.given_up),
        "retiring": {k: v.isoformat() for k, v in p.retiring.items()},
        "batches_done": p.batches_done,
        "progress_at": _iso(p.progress_at),
    }


def progress_from_json(d: Mapping[str, Any]) -> Progress:
    return Progress(
        strategy=Strategy(d["strategy"]),
        generation=int(d["generation"]),
        from_generation=int(d["from_generation"]),
        batch_size=int(d.get("batch_size", 1)),
        rolling_back=bool(d.get("rolling_back", False)),
        reason=str(d.get("reason", "")),
        batch=tuple(int(x) for x in d.get("batch", ())),
        candidates={int(k): str(v) for k, v in (d.get("candidates") or {}).items()},
        attempt=int(d.get("attempt", 1)),
        batch_since=_dt(d.get("batch_since")),
        drain_since=_dt(d.get("drain_since")),
        old_stopped=bool(d.get("old_stopped", False)),
        drain=bool(d.get("drain", True)),
        given_up=tuple(int(x) for x in d.get("given_up", ())),
        retiring={
            str(k): dt for k, v in (d.get("retiring") or {}).items()
            if (dt := _dt(v)) is not None
        },
        batches_done=int(d.get("batches_done", 0)),
        progress_at=_dt(d.get("progress_at")),
    )
