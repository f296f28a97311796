"""What every batch does, forward or back: index the replicas, wait, tell when a
draining replica may stop, switch a batch's ranks to their candidates, and put an
attempt's candidates away.

Retiring: a task the rollout stops while it may hold requests (a running candidate of a
failed attempt) is drained first and stopped once drained (``Progress.retiring``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from heteroflow.core.events import EventKind
from heteroflow.core.rollout.model import (
    Progress,
    Promote,
    Replica,
    RolloutPolicy,
    RolloutState,
    Step,
    Strategy,
)
from heteroflow.core.states import TaskStatus


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


class View:
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


def ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def dispose(
    p: Progress, v: View, now: datetime
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
        if r.status == TaskStatus.RUNNING and r.serves:
            retiring.setdefault(tid, now)
        else:
            stop.append(tid)
    undrain = []
    if p.drain_since is not None:
        undrain = [r.id for rank in p.batch for r in v.current_of(rank) if r.draining and r.live]
    return retiring, stop, undrain


def state_of(p: Progress) -> RolloutState:
    if p.rolling_back:
        return RolloutState.ROLLING_BACK
    return RolloutState.RECREATING if p.strategy == Strategy.RECREATE else RolloutState.ROLLING


def wait(p: Progress, message: str) -> Step:
    return Step(progress=p, state=state_of(p), message=message)


def switch(p: Progress, v: View, now: datetime, label: str, why: str) -> Step:
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
        progress=nxt, state=state_of(p), message=text, promote=promote,
        events=((EventKind.ROLLOUT_BATCH, text),),
    )


def serving_text(v: View) -> str:
    gens: dict[int, list[int]] = {}
    for rank in v.ranks:
        head = v.head(rank)
        if head is not None:
            gens.setdefault(head.generation, []).append(rank)
    if len(gens) == 1:
        (gen,) = gens
        return f"generation {gen} serves"
    return "; ".join(f"generation {gen} on {ranks_text(rs)}" for gen, rs in sorted(gens.items()))
