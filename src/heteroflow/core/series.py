"""Live time series (issue 33): the metric names, the buckets, the bound, downsampling: pure.

The server samples what it already receives (the gateways' load reports, the agents'
heartbeats, the tasks' states) every ``RAW_STEP_S`` and keeps, per series (a service, a
node or a card), two resolutions:

* **raw**: one point per ``RAW_STEP_S`` (10 s) for the last ``RAW_KEEP_S`` (1 h);
* **minute**: one point per ``MINUTE_STEP_S`` (60 s), the mean of that minute's raw
  samples, for the last ``MINUTE_KEEP_S`` (24 h).

Older points are dropped. A series therefore holds at most ``MAX_POINTS_PER_SERIES``
(360 + 1,440 = 1,800) points, whatever the traffic; a point's values are a fixed set of
named numbers (``SERVICE_METRICS``, ``NODE_METRICS``, ``CARD_METRICS``), so a point's size
is bounded too (``MAX_POINT_BYTES``). The minute point is written as the minute goes (a
running mean: ``merge``), so nothing has to be caught up after a restart or a change of
leader: a minute sampled half by one leader and half by the next is the mean of both
halves.

``SeriesBook`` is the same store in memory — the model the unit tests check the bound
and the downsampling on; the server's store (``services/series/store.py``) writes the
same points to the database with the same ``merge`` and the same cut-offs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

RAW_STEP_S = 10
RAW_KEEP_S = 3600
MINUTE_STEP_S = 60
MINUTE_KEEP_S = 24 * 3600
STEPS = (RAW_STEP_S, MINUTE_STEP_S)
MAX_POINTS_PER_SERIES = RAW_KEEP_S // RAW_STEP_S + MINUTE_KEEP_S // MINUTE_STEP_S

# per service (a task group): rates are per second over the sampling interval
SERVICE_METRICS = (
    "requests_per_s",  # answered by its replicas, through every gateway
    "tokens_per_s",  # prompt + completion, over the gateways' 30 s window
    "latency_p50_ms",  # arrival at the gateway to the answer's end (30 s window)
    "latency_p95_ms",
    "ttft_p50_ms",  # arrival to the answer's first bytes (a stream's first token)
    "ttft_p95_ms",
    "errors_per_s",  # answered with a status >= 400 or left by the client
    "errors_4xx_per_s",  # 4xx other than 429
    "errors_429_per_s",
    "errors_5xx_per_s",
    "client_left_per_s",  # the client went away before the answer's end
    "in_flight",  # requests in flight through the gateways now
    "queue",  # the engines' own queues (their /metrics), when scraped
    "replicas",  # replicas running
    "prefix_hit_rate",  # 0..1: prefix-cache hits / queries, where the engine reports it
)
# per node: the host's CPU and memory (every heartbeat carries them)
NODE_METRICS = ("cpu_percent", "memory_percent")
# per card: memory the card reports used, what the scheduler committed (0..100 % of the
# card by the tasks placed on it), temperature where reported
CARD_METRICS = (
    "memory_used_mb",
    "memory_total_mb",
    "committed_pct",
    "utilisation_pct",
    "temperature_c",
)
METRICS = {"service": SERVICE_METRICS, "node": NODE_METRICS, "card": CARD_METRICS}
SCOPES = tuple(METRICS)

# a point's values as stored: {"metric": value, ...} with at most one number per metric,
# plus the minute points' sample counts ("#": n, and "#metric": n for a metric missing
# from some samples); numbers are rounded to 4 digits after the point, so a value is at
# most ~20 characters
_MAX_VALUE_CHARS = 20
MAX_POINT_BYTES = sum(
    # "name":value, and "#name":count, for the largest metric set
    2 * (len(m) + 4) + _MAX_VALUE_CHARS + 8
    for m in SERVICE_METRICS
) + 2

Values = dict[str, float]


@dataclass(frozen=True, slots=True)
class Point:
    at: datetime  # the bucket's start (UTC)
    values: Mapping[str, float]


def bucket(at: datetime, step_s: int) -> datetime:
    """The start of the ``step_s`` bucket ``at`` falls in (UTC, aligned on the epoch)."""
    ts = at.astimezone(UTC).timestamp()
    return datetime.fromtimestamp(ts - ts % step_s, UTC)


def keep_from(now: datetime, step_s: int) -> datetime:
    """Points of resolution ``step_s`` older than this are dropped."""
    keep = RAW_KEEP_S if step_s == RAW_STEP_S else MINUTE_KEEP_S
    return bucket(now, step_s) - timedelta(seconds=keep)


def clean(values: Mapping[str, float | None], scope: str) -> Values:
    """Only the scope's metrics, finite numbers, rounded: what a point may hold."""
    known = METRICS[scope]
    out: Values = {}
    for name in known:
        v = values.get(name)
        if v is None or isinstance(v, bool) or not math.isfinite(v):
            continue
        out[name] = round(float(v), 4)
    return out


def merge(prev: Mapping[str, float] | None, new: Mapping[str, float]) -> Values:
    """A minute point with one more raw sample: each metric's running mean. ``#`` counts
    the samples merged; a metric missing from some of them (not counted there) keeps its
    own count as ``#metric`` — only then, so a minute point is not twice a raw one."""
    prev = prev or {}
    n_all = int(prev.get("#", 0))
    out: Values = {"#": n_all + 1}
    for name in dict.fromkeys([*prev, *new]):
        if name.startswith("#"):
            continue
        old = prev.get(name)
        n = int(prev.get("#" + name, n_all)) if old is not None else 0
        v = new.get(name)
        if v is not None:
            out[name] = round(v if old is None or n <= 0 else (old * n + v) / (n + 1), 4)
            n += 1
        elif old is not None:
            out[name] = old
        if n != n_all + 1:
            out["#" + name] = n
    return out


def public(values: Mapping[str, float]) -> Values:
    """A stored point's values without the counts."""
    return {k: v for k, v in values.items() if not k.startswith("#")}


def point_bytes(values: Mapping[str, float]) -> int:
    """A point's stored size (its JSON), what the bound counts."""
    return len(json.dumps(values, separators=(",", ":")))


def resample(points: Sequence[Point], step_s: int, metrics: Iterable[str]) -> list[Point]:
    """``points`` (ascending, of a finer step dividing ``step_s``) averaged into buckets
    of ``step_s``; only ``metrics``; a bucket with no value of any of them is left out."""
    wanted = tuple(metrics)
    out: list[Point] = []
    cur: datetime | None = None
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def close() -> None:
        if cur is not None and counts:
            out.append(Point(cur, {m: round(sums[m] / counts[m], 4) for m in counts}))

    for p in points:
        b = bucket(p.at, step_s)
        if b != cur:
            close()
            cur, sums, counts = b, {}, {}
        for m in wanted:
            v = p.values.get(m)
            if v is not None:
                sums[m] = sums.get(m, 0.0) + v
                counts[m] = counts.get(m, 0) + 1
    close()
    return out


def step_for(span_s: float, step_s: int | None) -> int:
    """The stored resolution a read of the last ``span_s`` seconds at ``step_s`` uses:
    raw points only exist for the last hour."""
    if span_s <= RAW_KEEP_S and (step_s is None or step_s % MINUTE_STEP_S):
        return RAW_STEP_S
    return MINUTE_STEP_S


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` (0..1) percentile by nearest rank; None for no values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def error_kind(status: int) -> str | None:
    """How an answer counts among the errors (None: not an error); status 0 or 499:
    the client left before the answer ended."""
    if status in (0, 499):
        return "client_left"
    if status == 429:
        return "429"
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "5xx"
    return None


ERROR_METRIC = {
    "4xx": "errors_4xx_per_s",
    "429": "errors_429_per_s",
    "5xx": "errors_5xx_per_s",
    "client_left": "client_left_per_s",
}


class SeriesBook:
    """The store in memory (what the bound is proved on; see the module docstring)."""

    def __init__(self) -> None:
        # (scope, key) -> step -> bucket start -> values
        self._series: dict[tuple[str, str], dict[int, dict[datetime, Values]]] = {}

    def add(self, scope: str, key: str, at: datetime, values: Mapping[str, float | None]) -> None:
        self.add_sample(at, {(scope, key): values})

    def add_sample(
        self, at: datetime, sample: Mapping[tuple[str, str], Mapping[str, float | None]]
    ) -> None:
        """One round: every series of ``sample`` at ``at`` (as the server's store)."""
        raw, minute = bucket(at, RAW_STEP_S), bucket(at, MINUTE_STEP_S)
        for (scope, key), values in sample.items():
            vals = clean(values, scope)
            steps = self._series.setdefault((scope, key), {RAW_STEP_S: {}, MINUTE_STEP_S: {}})
            steps[RAW_STEP_S][raw] = vals
            steps[MINUTE_STEP_S][minute] = merge(steps[MINUTE_STEP_S].get(minute), vals)

    def prune(self, now: datetime, alive: Iterable[tuple[str, str]] | None = None) -> None:
        """Drop the points past their resolution's window (and, given ``alive``, the
        series not in it once they hold no point)."""
        cuts = {step: keep_from(now, step) for step in STEPS}
        for steps in self._series.values():
            for step, points in steps.items():
                old = []
                for at in points:  # in time order (added in time order): stop at the cut
                    if at >= cuts[step]:
                        break
                    old.append(at)
                for at in old:
                    del points[at]
        keep = set(alive) if alive is not None else None
        for k in [k for k, st in self._series.items() if not any(st.values())]:
            if keep is None or k not in keep:
                del self._series[k]

    def points(self, scope: str, key: str, step: int) -> list[Point]:
        steps = self._series.get((scope, key), {})
        return [Point(a, public(v)) for a, v in sorted(steps.get(step, {}).items())]

    def count(self) -> int:
        return sum(len(p) for st in self._series.values() for p in st.values())

    def bytes(self) -> int:
        return sum(
            point_bytes(v) for st in self._series.values() for p in st.values() for v in p.values()
        )


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int = 60) -> str:
    """The last ``width`` values as a line of block characters (a gap: a space), scaled
    from 0 to their maximum: what ``heteroflow services top`` prints."""
    tail = list(values)[-width:]
    top = max((v for v in tail if v is not None), default=0.0)
    out = []
    for v in tail:
        if v is None:
            out.append(" ")
        elif top <= 0:
            out.append(_BARS[0])
        else:
            out.append(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))])
    return "".join(out)
