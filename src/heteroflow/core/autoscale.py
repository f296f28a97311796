"""Replica bounds (A1, I2) and the autoscaler's rule (I1), pure: facts in, a decision out.

``services/lifecycle/scaling.py`` reads the facts (the group, its current replicas, the gateways'
load reports through ``services/tenancy/usage.read_load``) and writes what ``decide`` says.
Nothing here reads a clock or a database.

**Who scales.** Inference services whose parallelism is ``single``, ``split`` or
``tensor_parallel``: a replica is one task (one card, a CPU engine, or ``world_size``
cards of one node for tensor parallelism), and ``N`` replicas are ranks ``0..N-1``.
A ``single`` group scaled to 3 is three replicas of one task each. Pipeline groups (one
model across stages) and training / container groups keep the task count they were
created with; their ``min_replicas`` and ``max_replicas`` equal it.

**Bounds.** ``1 <= min_replicas <= current_replicas <= max_replicas <= MAX_REPLICAS``.
Rank 0 is never scaled away, so there is always at least one replica.

**The rule.** Every round, for each group whose ``scale_policy`` is enabled::

    desired = ceil(current * metric / target)      metric = per replica, see below
    metric 0 (idle)  -> desired = min_replicas
    clamp to [min_replicas, max_replicas]; the whole difference at once
    a scale-out is clamped to what the tenant's quotas allow (N2, core/quotas.py)

The metric is the group's total divided by ``current_replicas`` (replicas still starting
included), so ``desired`` is in fact ``ceil(total / target)``: a burst that arrives while
new replicas start does not add replicas for the ones already on their way.

* ``inflight``: requests in flight on the group's current replicas, summed over the
  gateways that reported within the staleness window;
* ``tokens_per_s``: tokens (prompt + completion) per second the gateways saw the
  replicas answer, over the gateways' last 30 s;
* ``queue``: requests waiting inside the engines (their own ``/metrics``; the largest
  value any gateway scraped per replica);
* ``kv_cache``: KV-cache use in percent (0-100), the mean over replicas whose engine
  exports it.

No fresh gateway report (or, for ``queue`` / ``kv_cache``, no replica whose engine
exports the gauge) means no data: the group is left as it is, and the event says why.

**Protections on the way down.** The highest ranks leave first and rank 0 never does;
a replica younger than ``min_age_s`` (60 s; from ``running_at``, or from its creation
when it never ran) is kept, and with it every rank below it (ranks stay contiguous), so
a scale-down stops above the youngest replica it would otherwise have taken.

**Skipped groups.** Not meant to run (``desired`` stopped), a schedule window's action
in effect (``window_action``: the window executor owns the replica count then), a
rolling update in progress (``rollout_holder``), or a replica asleep or waking.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from heteroflow.core.errors import ValidationFailed

MAX_REPLICAS = 64
METRICS: tuple[str, ...] = ("inflight", "tokens_per_s", "queue", "kv_cache")
Metric = Literal["inflight", "tokens_per_s", "queue", "kv_cache"]
SCALABLE_PARALLELISM = frozenset({"single", "split", "tensor_parallel"})
DEFAULT_MIN_AGE_S = 60.0
# a ratio that should be an integer (3 * 4 / 4) must not become 3.0000000001 -> 4
_EPSILON = 1e-9
# how the metric is said in events and messages
UNITS: Mapping[str, str] = {
    "inflight": "requests in flight per replica",
    "tokens_per_s": "tokens/s per replica",
    "queue": "requests waiting per replica",
    "kv_cache": "% KV cache in use",
}


# ---- who may scale, and the bounds --------------------------------------------------


def scalable_problem(task_type: str, parallelism: str) -> str | None:
    """Why a group cannot change its replica count (None: it can)."""
    if task_type != "inference":
        return (
            f"only inference services scale; a {task_type} group keeps the tasks it was "
            "created with"
        )
    if parallelism not in SCALABLE_PARALLELISM:
        return (
            f"a {parallelism} group serves one model across its stages and cannot scale; "
            "use single, split or tensor_parallel"
        )
    return None


def bounds_problem(lo: int, current: int, hi: int) -> tuple[str, str] | None:
    """(field, message) when ``lo <= current <= hi`` (within 1..MAX_REPLICAS) fails."""
    if not 1 <= lo <= MAX_REPLICAS:
        return "min_replicas", f"min_replicas {lo} must be 1-{MAX_REPLICAS}"
    if not 1 <= hi <= MAX_REPLICAS:
        return "max_replicas", f"max_replicas {hi} must be 1-{MAX_REPLICAS}"
    if current < lo:
        return (
            "min_replicas",
            f"min_replicas {lo} is above the group's {current} replica(s)",
        )
    if current > hi:
        return (
            "max_replicas",
            f"max_replicas {hi} is below the group's {current} replica(s)",
        )
    if lo > hi:  # unreachable with current in between; kept for the rule's sake
        return "max_replicas", f"max_replicas {hi} is below min_replicas {lo}"
    return None


def create_bounds(
    *,
    replicas: int,
    task_type: str,
    parallelism: str,
    min_replicas: int | None,
    max_replicas: int | None,
    prefix: str = "",
) -> tuple[int, int]:
    """The (min, max) a new group gets: given values, else the replica count it starts
    with (``max`` at least ``min``). Raises ``ValidationFailed`` naming the field."""
    lo = replicas if min_replicas is None else min_replicas
    hi = max(replicas, lo) if max_replicas is None else max_replicas
    if (lo, hi) != (replicas, replicas):
        problem = scalable_problem(task_type, parallelism)
        if problem is not None:
            name = "min_replicas" if lo != replicas else "max_replicas"
            raise ValidationFailed(
                f"{name}: {problem} ({replicas})", field=prefix + name
            )
    bad = bounds_problem(lo, replicas, hi)
    if bad is not None:
        name, message = bad
        raise ValidationFailed(message, field=prefix + name)
    return lo, hi


# ---- the policy ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """``task_groups.scale_policy`` as the autoscaler reads it."""

    enabled: bool = False
    metric: str = "inflight"
    target: float = 0.0

    @classmethod
    def from_json(cls, data: Mapping[str, object] | None) -> ScalePolicy:
        """A stored policy; anything unusable reads as disabled."""
        if not data:
            return cls()
        metric = data.get("metric")
        target = data.get("target")
        enabled = data.get("enabled") is True
        if metric not in METRICS or not isinstance(target, int | float) or target <= 0:
            return cls(enabled=False)
        return cls(enabled=enabled, metric=str(metric), target=float(target))

    def to_json(self) -> dict[str, object]:
        return {"enabled": self.enabled, "metric": self.metric, "target": self.target}

    def describe(self) -> str:
        state = "on" if self.enabled else "off"
        return f"autoscaling {state}: {self.metric} target {self.target:g} ({UNITS[self.metric]})"


def target_problem(metric: str, target: float) -> str | None:
    if target <= 0:
        return "target must be above 0"
    if metric == "kv_cache" and target > 100:
        return "kv_cache is a percentage: the target must be 1-100"
    return None


# ---- the load the gateways report -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One gateway's view of one replica at its last report."""

    in_flight: int = 0
    tokens_per_s: float = 0.0
    waiting: float | None = None  # the engine's own queue (its /metrics), when scraped
    kv_use: float | None = None  # 0..1, when the engine exports it
    draining: bool = False  # as the gateway's routing snapshot says


@dataclass(frozen=True, slots=True)
class LoadView:
    """What the gateways that reported within the staleness window say.

    ``gateways``: how many reported; ``as_of``: the oldest of those reports (every
    figure is at least that fresh); ``samples``: per task, one per gateway that routes
    to it (a gateway whose snapshot does not list a task sends it nothing).
    """

    gateways: int = 0
    as_of: datetime | None = None
    samples: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)

    def in_flight(self, task_id: str) -> int:
        return sum(s.in_flight for s in self.samples.get(task_id, ()))

    def tokens_per_s(self, task_id: str) -> float:
        return sum(s.tokens_per_s for s in self.samples.get(task_id, ()))

    def waiting(self, task_id: str) -> float | None:
        known = [s.waiting for s in self.samples.get(task_id, ()) if s.waiting is not None]
        return max(known) if known else None

    def kv_use(self, task_id: str) -> float | None:
        known = [s.kv_use for s in self.samples.get(task_id, ()) if s.kv_use is not None]
        return max(known) if known else None

    def drained(self, task_id: str) -> bool:
        """Nothing in flight on it at any gateway, and every gateway that routes to it
        knows it drains (so none sends it a new request): it may stop."""
        return all(s.draining and s.in_flight == 0 for s in self.samples.get(task_id, ()))

    def in_flight_of(self, task_ids: Iterable[str]) -> dict[str, tuple[int, datetime]]:
        """task id -> (requests in flight, as of when); empty when no gateway reported."""
        if self.as_of is None:
            return {}
        return {t: (self.in_flight(t), self.as_of) for t in task_ids}


def group_metric(
    metric: str, load: LoadView, task_ids: Sequence[str], current: int
) -> float | None:
    """The group's metric per replica (see the module docstring); None: no data."""
    if load.gateways == 0 or current <= 0:
        return None
    if metric == "inflight":
        return sum(load.in_flight(t) for t in task_ids) / current
    if metric == "tokens_per_s":
        return sum(load.tokens_per_s(t) for t in task_ids) / current
    if metric == "queue":
        waiting = [w for t in task_ids if (w := load.waiting(t)) is not None]
        return sum(waiting) / current if waiting else None
    if metric == "kv_cache":
        kv = [k for t in task_ids if (k := load.kv_use(t)) is not None]
        return 100.0 * sum(kv) / len(kv) if kv else None
    return None


# ---- the decision -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Replica:
    """One current replica, as the protections see it."""

    task_id: str
    rank: int
    running_at: datetime | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Decision:
    metric: str
    target: float
    value: float | None  # the metric per replica; None: no data
    current: int
    raw: int  # the formula's answer, before bounds and protections
    desired: int
    notes: tuple[str, ...] = ()  # why desired differs from raw (clamped, held)
    no_data: str = ""  # why nothing was decided

    @property
    def changes(self) -> bool:
        return self.desired != self.current

    @property
    def key(self) -> str:
        """What the timeline compares to say a decision only once: the count and the
        kinds of notes ("3", "3:clamped", "3:held"), or "skip:no-data"."""
        if self.no_data:
            return "skip:no-data"
        return ":".join([str(self.desired), *(n.split(" ", 1)[0] for n in self.notes)])

    def describe(self) -> str:
        if self.no_data:
            return f"no decision: {self.no_data}"
        unit = UNITS.get(self.metric, self.metric)
        text = (
            f"{self.metric} {self.value:.2f} ({unit}), target {self.target:g}: "
            f"ceil({self.current} * {self.value:.2f} / {self.target:g}) = {self.raw}"
            if self.value
            else f"{self.metric} 0 ({unit}): idle, min_replicas {self.raw}"
        )
        for note in self.notes:
            text += f"; {note}"
        verb = "scale" if self.changes else "stay"
        return f"{text}; {verb} {self.current} → {self.desired}"


def formula(current: int, value: float, target: float, lo: int) -> int:
    """ceil(current * value / target); an idle group (value 0) goes to ``lo``."""
    if value <= 0:
        return lo
    return max(1, math.ceil(current * value / target - _EPSILON))


def protect(
    desired: int, replicas: Sequence[Replica], now: datetime, min_age_s: float
) -> tuple[int, str]:
    """Keep rank 0 and every replica younger than ``min_age_s`` (with the ranks below
    it): the lowest count a scale-down may reach, and why it was raised ("" if not)."""
    floor, why = max(desired, 1), ""
    for r in sorted(replicas, key=lambda r: -r.rank):
        if r.rank < floor:
            break
        since = r.running_at or r.created_at
        age = (now - since).total_seconds()
        if age < min_age_s:
            floor = r.rank + 1
            started = "running" if r.running_at is not None else "created"
            why = (
                f"held at {floor}: rank {r.rank} ({r.task_id}) {started} {age:.0f} s ago, "
                f"younger than {min_age_s:g} s"
            )
            break
    return floor, why


def decide(
    *,
    policy: ScalePolicy,
    current: int,
    lo: int,
    hi: int,
    value: float | None,
    replicas: Sequence[Replica],
    now: datetime,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    no_data: str = "",
    quota: tuple[int, str] | None = None,
) -> Decision:
    """One group's decision for this round (see the module docstring). ``quota``: how
    many more replicas the tenant's quotas allow and why (``core.quotas.headroom``;
    None = no limit): a scale-out is clamped to it, never below ``current``."""
    if value is None:
        return Decision(
            metric=policy.metric, target=policy.target, value=None, current=current,
            raw=current, desired=current,
            no_data=no_data or f"no {policy.metric} figure from the gateways",
        )
    raw = formula(current, value, policy.target, lo)
    desired, notes = raw, []
    if desired > hi:
        desired = hi
        notes.append(f"clamped to max_replicas {hi}")
    elif desired < lo:
        desired = lo
        notes.append(f"clamped to min_replicas {lo}")
    if quota is not None and desired > current + quota[0]:
        desired = current + max(0, quota[0])
        notes.append(f"quota-clamped to {desired}: {quota[1]}")
    if desired < current:
        floor, why = protect(desired, replicas, now, min_age_s)
        if floor > desired:
            desired = min(floor, current)
            notes.append(why)
    return Decision(
        metric=policy.metric, target=policy.target, value=value, current=current,
        raw=raw, desired=desired, notes=tuple(notes),
    )


# why a group is left alone this round: (short key for the timeline's to_status, text)
SkipReason = tuple[str, str]


def skip_reason(
    *,
    desired_state: str,
    window_action: str,
    rollout_holder: str,
    task_statuses: Iterable[str],
) -> SkipReason | None:
    if desired_state != "running":
        return "stopped", "the service is stopped by its owner"
    if window_action:
        return (
            "window",
            f"its schedule window's action {window_action!r} is in effect (the window "
            "owns the replica count until it is lifted)",
        )
    if rollout_holder:
        return "rollout", "a rolling update is in progress"
    if set(task_statuses) & {"sleeping", "waking"}:
        return "asleep", "the service is asleep or waking"
    return None
