"""A rollout given up, the candidates it left behind, and the lease that decides.

**Abandon (J4):** when the holder lost its lease (the expiry scan), held it too long
(``max_hold_s``) or the service was stopped or deleted, ``abandon`` leaves the group as it
serves: candidates that were never switched are stopped (a running one is drained
first; the scan stops it once drained), old replicas it drained serve again, ranks
already switched keep the new generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime

from heteroflow.core.events import EventKind
from heteroflow.core.rollout.batch import View, serving_text
from heteroflow.core.rollout.model import (
    Progress,
    Replica,
    RolloutPolicy,
    RolloutState,
    Step,
    Strategy,
)
from heteroflow.core.states import TaskStatus


def abandon(p: Progress, replicas: Sequence[Replica], reason: str, *, hard: bool) -> Step:
    """Give the rollout up where it stands (lease expired or held too long, the service
    stopped or deleted): candidates never switched in are stopped — with ``hard`` at once,
    else a running one is drained first (``orphans`` stops it once drained) —, old
    replicas it drained serve again, ranks already switched keep the new generation."""
    v = View(replicas)
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
    text = f"{reason}; {serving_text(v)}" if v.ranks else reason
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
