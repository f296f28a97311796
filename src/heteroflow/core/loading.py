"""Start and wake windows that follow loading (FEATURES D5): the verdict on a load, pure.

An inference engine between its launch (or its wake) and its first passing health check
is loading its model. Whether it is still getting somewhere is read from samples the
agent takes (``LoadSample``: the bytes the engine has read from storage, a mark that moves
when it writes to its log, the engine's own word on its weights) and judged here
(``LoadWatch``): ``loading`` while something moves, ``stalled`` once nothing has moved for
``stall_s``, ``overdue`` past the ceiling, ``ready`` at the first pass (the caller says so).
Nothing here reads a clock or a file: every time is passed in (seconds on any monotonic
clock).

Decisions:

* **Progress** is any of: the bytes read grew by at least ``PROGRESS_MIN_BYTES`` since
  the last progress (a config file or a probe's socket is not a model load; ``read_bytes``
  counts storage only, never the page cache); the engine's own fraction grew; its log
  mark moved; it was busy — its CPU time grew by at least ``BUSY_SHARE`` of one core
  over the time since the last sample. Busy counts because what follows the weights is
  silent and reads nothing: vLLM's warm-up compilation on this CI machine logged nothing
  for 27 s (a recorded run), torch.compile and CUDA-graph capture on a GPU take minutes.
  An idle process (an API server waiting on a dead engine core, a loader asleep on a
  dead disk) stays far below a quarter of a core. A hang that spins (a CUDA sync that
  busy-waits) looks busy: the ceiling ends it. A repeated identical log line is not
  progress (the agent's mark is the tail's text). Being up and answering "Loading
  model" (llama-server's 503) is not progress either: its HTTP thread answers while its
  loader hangs on a dead disk.
* **Stalled**: no progress for ``stall_s``, counted from the window's start or the last
  progress, never inside ``grace_s`` (the task's start period: its owner's minimum).
* **Ceiling**: a window that shows progress for ever (a loop that logs, a process that
  rereads a file) still ends: past ``max(ceiling_s, CEILING_FACTOR x expected time)``
  (``ceiling_s`` 0: none). A slow disk is never the reason: the expected time grows with
  the model and shrinks with the node's measured read rate.
* **Expected time** is the model's size over the node's read rate (``ReadRate``): the
  default before this node has measured a load, then the mean of the last estimate and
  each new load's own rate (bytes read over the time until its last byte arrived; loads
  under ``MEASURE_MIN_BYTES`` — a model from the page cache — measure nothing).
* **ETA**: from the engine's own fraction when it gives one; else the bytes left over
  this load's own rate (the node's rate before it has read enough to have one); else the
  expected time left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

MB = 1_000_000
GB = 1_000_000_000
#: Growth of the bytes read smaller than this is not progress.
PROGRESS_MIN_BYTES = 1 << 20
#: CPU time over wall time (one core = 1.0) from which an engine counts as busy.
BUSY_SHARE = 0.25
#: A load that read less than this says nothing about the node's read rate.
MEASURE_MIN_BYTES = 64 << 20
#: The ceiling is at least this many times the expected load time.
CEILING_FACTOR = 3.0
#: The read rate assumed before a node has measured a load: a SATA SSD or a fair
#: network volume; NVMe is faster, so the first ETA errs long rather than short.
DEFAULT_READ_BPS = 200 * MB


class LoadVerdict(StrEnum):
    LOADING = "loading"  # still getting somewhere (or inside its grace)
    STALLED = "stalled"  # nothing moved for stall_s: stop it
    OVERDUE = "overdue"  # past the ceiling although it moved: stop it
    READY = "ready"  # its first health check passed: the window is over


@dataclass(frozen=True, slots=True)
class LoadSample:
    """What the agent saw of a loading engine at ``at``; None: not known here."""

    at: float
    read_bytes: int | None = None  # from storage, by the engine (process tree / container)
    log_mark: int | None = None  # moves whenever the engine wrote new log lines
    fraction: float | None = None  # the engine's own word: share of its weights loaded
    says_loading: bool = False  # it answers that it is loading (llama-server's 503)
    cpu_s: float | None = None  # CPU seconds its processes have used (user + system)


@dataclass(frozen=True, slots=True)
class LoadPolicy:
    stall_s: float = 120.0
    ceiling_s: float = 3600.0  # 0 = none

    def __post_init__(self) -> None:
        if not (math.isfinite(self.stall_s) and self.stall_s > 0):
            raise ValueError(f"stall_s: must be a number > 0, got {self.stall_s!r}")
        if not (math.isfinite(self.ceiling_s) and self.ceiling_s >= 0):
            raise ValueError(f"ceiling_s: must be a number >= 0, got {self.ceiling_s!r}")


@dataclass(frozen=True, slots=True)
class ReadRate:
    """A node's read rate for model loads (bytes per second) and whether it was measured."""

    bps: float = DEFAULT_READ_BPS
    measured: bool = False

    def with_load(self, read_bytes: int, seconds: float) -> ReadRate:
        """The estimate after one more load (unchanged when it says nothing)."""
        if read_bytes < MEASURE_MIN_BYTES or not (math.isfinite(seconds) and seconds > 0):
            return self
        rate = read_bytes / seconds
        return ReadRate(rate if not self.measured else (self.bps + rate) / 2, True)

    def describe(self) -> str:
        how = "measured on this node" if self.measured else "default: no load measured here yet"
        return f"{self.bps / MB:.0f} MB/s, {how}"


def size_text(n: int) -> str:
    """Bytes for people, decimal: ``512 B``, ``12 KB``, ``540 MB``, ``4.5 GB``."""
    if n >= GB:
        return f"{n / GB:.1f} GB"
    if n >= MB:
        return f"{n / MB:.0f} MB"
    if n >= 1000:
        return f"{n / 1000:.0f} KB"
    return f"{n} B"


def pair_text(done: int, total: int) -> str:
    """``1.2 of 4.5 GB``: both in the total's unit."""
    unit, div, fmt = ("GB", GB, ".1f") if total >= GB else ("MB", MB, ".0f")
    if total < MB:
        unit, div, fmt = ("KB", 1000, ".0f")
    return f"{done / div:{fmt}} of {total / div:{fmt}} {unit}"


def about(seconds: float) -> str:
    """``~40 s``, ``~3 min``, ``~1.5 h``; ``under 1 s``."""
    return "under 1 s" if seconds < 1 else f"~{duration_text(seconds)}"


def duration_text(seconds: float) -> str:
    """``40 s``, ``3 min``, ``1.5 h``."""
    if seconds < 90:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True, slots=True)
class LoadReading:
    """The verdict on a load at one sample, and what to tell people about it."""

    verdict: LoadVerdict
    elapsed_s: float
    idle_s: float  # since the last progress (or the window's start)
    read_bytes: int | None
    expected_bytes: int | None
    fraction: float | None
    eta_s: float | None
    says_loading: bool = False

    def progress_text(self) -> str:
        """How far: ``1.2 of 4.5 GB``, ``1.2 GB read``, ``shards 50%``, ``nothing read yet``."""
        parts: list[str] = []
        if self.read_bytes is not None and self.expected_bytes:
            parts.append(pair_text(self.read_bytes, self.expected_bytes))
        elif self.read_bytes:
            parts.append(f"{size_text(self.read_bytes)} read")
        if self.fraction is not None:
            parts.append(f"weights {self.fraction:.0%} (engine)")
        if not parts:
            parts.append("nothing read yet" if self.read_bytes == 0 else "no progress figure")
        return ", ".join(parts)

    def message(self) -> str:
        """The task's status message while it loads: ``loading: 1.2 of 4.5 GB, ~3 min left``."""
        text = f"loading: {self.progress_text()}"
        if self.eta_s is not None:
            text += ", finishing" if self.eta_s <= 0 else f", {about(self.eta_s)} left"
        if self.says_loading:
            text += "; the engine says it is loading"
        if self.idle_s >= 30:
            text += f"; no progress for {self.idle_s:.0f} s"
        return text

    def stop_reason(self, stall_s: float, ceiling_s: float | None) -> str:
        """Why a stalled or overdue load is stopped (the task's fault message)."""
        if self.verdict == LoadVerdict.OVERDUE:
            limit = f"{ceiling_s:.0f} s" if ceiling_s is not None else "its ceiling"
            return (
                f"load overdue: not ready {self.elapsed_s:.0f} s after its start although "
                f"still making progress (ceiling {limit}); {self.progress_text()}"
            )
        text = f"stalled: no progress for {self.idle_s:.0f} s"
        if self.read_bytes is not None:
            read = self.read_bytes
            done = pair_text(read, self.expected_bytes) if self.expected_bytes else size_text(read)
            text += f" after reading {done}"
        if self.fraction is not None:
            text += f" (weights {self.fraction:.0%} loaded, by its log)"
        return text


class LoadWatch:
    """One load window: from a launch or a wake to the first passing check."""

    def __init__(
        self,
        policy: LoadPolicy,
        started_at: float,
        *,
        grace_s: float = 0.0,
        expected_bytes: int | None = None,
        rate: ReadRate | None = None,
    ) -> None:
        self.policy = policy
        self.started_at = started_at
        self.grace_s = max(grace_s, 0.0)
        self.expected_bytes = expected_bytes if expected_bytes and expected_bytes > 0 else None
        self.rate = rate or ReadRate()
        self._last_progress = started_at
        self._bytes_mark = 0
        self._bytes_at: float | None = None  # when the bytes last grew
        self._read: int | None = None
        self._fraction = -1.0
        self._log_mark: int | None = None
        self._cpu: tuple[float, float] | None = None  # (at, cpu seconds) of the last sample
        self._says = False

    @property
    def expected_s(self) -> float | None:
        """The expected load time: the model's size over the node's read rate."""
        if self.expected_bytes is None:
            return None
        return self.expected_bytes / self.rate.bps

    @property
    def ceiling_s(self) -> float | None:
        """When the window ends however it progresses (None: never)."""
        if self.policy.ceiling_s <= 0:
            return None
        return max(self.policy.ceiling_s, CEILING_FACTOR * (self.expected_s or 0.0))

    def start_message(self, what: str = "loading") -> str:
        """The event at the window's start: what is loaded and how long it should take."""
        if self.expected_bytes is None:
            return f"{what}: model size unknown here; no expected time"
        expected = self.expected_s or 0.0
        return (
            f"{what} a {size_text(self.expected_bytes)} model: expected "
            f"{about(expected)} at {self.rate.describe()}"
        )

    def observe(self, s: LoadSample) -> LoadReading:
        """Fold one sample in and judge the load at ``s.at``."""
        if self._progressed(s):
            self._last_progress = max(self._last_progress, s.at)
        self._says = s.says_loading
        elapsed = s.at - self.started_at
        idle = max(s.at - self._last_progress, 0.0)
        ceiling = self.ceiling_s
        if ceiling is not None and elapsed >= ceiling:
            verdict = LoadVerdict.OVERDUE
        elif elapsed >= self.grace_s and idle >= self.policy.stall_s:
            verdict = LoadVerdict.STALLED
        else:
            verdict = LoadVerdict.LOADING
        return self._reading(verdict, s.at, idle)

    def ready(self, at: float) -> LoadReading:
        """The first passing check at ``at``: the window is over."""
        return self._reading(LoadVerdict.READY, at, max(at - self._last_progress, 0.0))

    def measured(self) -> tuple[int, float] | None:
        """This load's bytes and the seconds until the last of them arrived (the node's
        read rate learns from it), or None when it read too little to say anything."""
        if self._bytes_at is None or self._read is None or self._read < MEASURE_MIN_BYTES:
            return None
        seconds = self._bytes_at - self.started_at
        return (self._read, seconds) if seconds > 0 else None

    def _progressed(self, s: LoadSample) -> bool:
        moved = False
        if s.read_bytes is not None:
            self._read = s.read_bytes
            if s.read_bytes < self._bytes_mark:  # a child that ended took its count along
                self._bytes_mark = s.read_bytes
            elif s.read_bytes - self._bytes_mark >= PROGRESS_MIN_BYTES:
                self._bytes_mark, self._bytes_at, moved = s.read_bytes, s.at, True
        if s.fraction is not None and s.fraction > self._fraction:
            moved = moved or self._fraction >= 0 or s.fraction > 0
            self._fraction = s.fraction
        if s.log_mark is not None:
            moved = moved or (self._log_mark is not None and s.log_mark != self._log_mark)
            self._log_mark = s.log_mark
        if s.cpu_s is not None:
            if self._cpu is not None and s.at > self._cpu[0]:
                busy = (s.cpu_s - self._cpu[1]) / (s.at - self._cpu[0])
                moved = moved or busy >= BUSY_SHARE
            self._cpu = (s.at, s.cpu_s)
        return moved

    def _reading(self, verdict: LoadVerdict, at: float, idle: float) -> LoadReading:
        fraction = self._fraction if self._fraction >= 0 else None
        return LoadReading(
            verdict=verdict,
            elapsed_s=at - self.started_at,
            idle_s=idle,
            read_bytes=self._read,
            expected_bytes=self.expected_bytes,
            fraction=fraction,
            eta_s=self._eta(at, fraction),
            says_loading=self._says,
        )

    def _eta(self, at: float, fraction: float | None) -> float | None:
        elapsed = max(at - self.started_at, 0.0)
        if fraction is not None and 0 < fraction < 1:
            return elapsed * (1 - fraction) / fraction
        if fraction is not None and fraction >= 1:
            return 0.0
        if self.expected_bytes is None:
            return None
        read = self._read or 0
        if read >= self.expected_bytes:
            return 0.0
        if self._bytes_at is not None and read >= MEASURE_MIN_BYTES:
            spent = self._bytes_at - self.started_at
            if spent > 0:
                return (self.expected_bytes - read) / (read / spent)
        if read > 0:
            return (self.expected_bytes - read) / self.rate.bps
        return max((self.expected_s or 0.0) - elapsed, 0.0)
