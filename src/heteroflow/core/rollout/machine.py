"""One round of a rollout that holds its lease: retire what drained, then a step forward
(``forward``) or back (``rollback``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from heteroflow.core.rollout.batch import View, drained
from heteroflow.core.rollout.forward import forward
from heteroflow.core.rollout.model import InFlight, Progress, Replica, RolloutPolicy, Step
from heteroflow.core.rollout.rollback import rollback
from heteroflow.core.states import TaskStatus


def _retire(
    p: Progress, v: View, now: datetime, policy: RolloutPolicy, in_flight: InFlight
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


def step(
    p: Progress,
    replicas: Sequence[Replica],
    now: datetime,
    policy: RolloutPolicy,
    in_flight: InFlight | None = None,
) -> Step:
    """The next step of a rollout holding its lease."""
    v = View(replicas)
    p, stop = _retire(p, v, now, policy, in_flight or {})
    out = rollback(p, v, now, policy, in_flight or {}) if p.rolling_back else forward(
        p, v, now, policy, in_flight or {}
    )
    if stop:
        out = replace(out, stop=(*stop, *out.stop))
    return out
