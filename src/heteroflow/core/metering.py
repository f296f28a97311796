"""GPU time (N4), pure: which task states are metered, and a segment's time clipped to a
range and cut into UTC hour or day buckets.

**Metered states.** A task holds its cards in one of two: ``running`` — booked and
awake, from placement until its agent confirmed the stop (scheduled, starting, running,
waking, stopping) — and ``sleeping`` (F1: the engine is stopped, the commitment kept).
Pending, stopped, failed and completed tasks hold nothing. The one door for state
changes (``services/lifecycle/transitions.py``) writes a segment per stretch in one of them
(``services/tenancy/gpu_time.py``); a change inside one bucket (scheduled -> starting -> running)
writes nothing.

**What a segment is worth.** Its *card-seconds* are its commitment times its seconds —
``card_pct`` hundredths of a card, the rule quotas count by (``core.quotas.task_usage``:
a one-card inference replica its ``gpu_memory_utilization``, whole-card work 100 % per
card) — and its *task-seconds* the seconds alone (CPU work has task-seconds and no
card-seconds). Sums are kept as integers (microseconds, and hundredths of a card times
microseconds), so adding many pieces never drifts; ``Meter`` gives seconds at the end,
rounded to the millisecond.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

from heteroflow.core.states import TaskStatus

RUNNING: Final = "running"
SLEEPING: Final = "sleeping"

_RUNNING_STATES = frozenset(
    {
        TaskStatus.SCHEDULED,
        TaskStatus.STARTING,
        TaskStatus.RUNNING,
        TaskStatus.WAKING,
        TaskStatus.STOPPING,
    }
)

Unit = Literal["hour", "day"]
_STEP: dict[Unit, timedelta] = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
# the widest range a report may cut into buckets of each unit (bounds the work)
MAX_SPAN: dict[Unit, timedelta] = {"hour": timedelta(days=31), "day": timedelta(days=366)}
_US = timedelta(microseconds=1)


# the task states of each metered state
METERED: dict[str, frozenset[TaskStatus]] = {
    RUNNING: _RUNNING_STATES,
    SLEEPING: frozenset({TaskStatus.SLEEPING}),
}


def metered_state(status: TaskStatus) -> str | None:
    """``running``, ``sleeping`` or None (the task holds no cards)."""
    if status in _RUNNING_STATES:
        return RUNNING
    if status == TaskStatus.SLEEPING:
        return SLEEPING
    return None


def bucket_start(t: datetime, unit: Unit) -> datetime:
    """The UTC hour or day ``t`` falls in."""
    t = t.astimezone(UTC)
    if unit == "hour":
        return t.replace(minute=0, second=0, microsecond=0)
    return t.replace(hour=0, minute=0, second=0, microsecond=0)


def span_refusal(start: datetime | None, end: datetime, unit: Unit | None) -> str | None:
    """Why [start, end) is too wide to cut into ``unit`` buckets; None when it is not."""
    if unit is None:
        return None
    limit = MAX_SPAN[unit]
    if start is None:
        return f"grouping by {unit} needs a start (a range of at most {limit.days} days)"
    if end - start > limit:
        return (
            f"grouping by {unit} takes a range of at most {limit.days} days; "
            f"this one is {(end - start) / timedelta(days=1):g}"
        )
    return None


def pieces(
    started_at: datetime,
    ended_at: datetime | None,
    *,
    lo: datetime | None,
    hi: datetime,
    unit: Unit | None,
) -> list[tuple[datetime | None, int]]:
    """``[started_at, ended_at)`` clipped to ``[lo, hi)`` (an open segment, ``ended_at``
    None, runs to ``hi``: the report's end or now, whichever is first), as (the UTC
    bucket it falls in — None without ``unit`` —, microseconds) pieces, oldest first."""
    a = started_at if lo is None else max(started_at, lo)
    b = hi if ended_at is None else min(ended_at, hi)
    if b <= a:
        return []
    if unit is None:
        return [(None, (b - a) // _US)]
    out: list[tuple[datetime | None, int]] = []
    step = _STEP[unit]
    bucket = bucket_start(a, unit)
    while bucket < b:
        nxt = bucket + step
        lo_p, hi_p = max(a, bucket), min(b, nxt)
        out.append((bucket, (hi_p - lo_p) // _US))
        bucket = nxt
    return out


def _seconds(us: int, scale: int = 1) -> float:
    return round(us / (scale * 1_000_000), 3)


@dataclass(slots=True)
class Meter:
    """GPU time summed: card-seconds and task-seconds per metered state."""

    running_card_pct_us: int = 0  # hundredths of a card x microseconds
    sleeping_card_pct_us: int = 0
    running_us: int = 0
    sleeping_us: int = 0

    def add(self, state: str, card_pct: int, us: int) -> None:
        if state == RUNNING:
            self.running_card_pct_us += card_pct * us
            self.running_us += us
        elif state == SLEEPING:
            self.sleeping_card_pct_us += card_pct * us
            self.sleeping_us += us
        else:
            raise ValueError(f"not a metered state: {state!r}")

    def merge(self, other: Meter) -> None:
        self.running_card_pct_us += other.running_card_pct_us
        self.sleeping_card_pct_us += other.sleeping_card_pct_us
        self.running_us += other.running_us
        self.sleeping_us += other.sleeping_us

    @property
    def running_card_seconds(self) -> float:
        return _seconds(self.running_card_pct_us, 100)

    @property
    def sleeping_card_seconds(self) -> float:
        return _seconds(self.sleeping_card_pct_us, 100)

    @property
    def running_task_seconds(self) -> float:
        return _seconds(self.running_us)

    @property
    def sleeping_task_seconds(self) -> float:
        return _seconds(self.sleeping_us)
