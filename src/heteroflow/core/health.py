"""Container-level health-check policy (FEATURES D2/D3): the config and the verdicts.

Pure logic: no I/O and no clock reads; every time is passed in by the caller (seconds on
any monotonic clock). The agent probes a task's container (``agent.health_probe``), feeds
each result to the task's ``HealthTracker`` and acts on the verdict: the first pass makes
the task routable, ``UNHEALTHY`` fails the task (the agent kills the container). This is
separate from the gateway's endpoint probe, which only removes a backend from routing.

Decisions:

* The start period is a plain time window from the container's real start (or from the
  last ``resume``): failures inside it are reported as ``IGNORED_IN_START_PERIOD`` (to be
  logged) and never counted, even after an earlier pass.
* ``HEALTHY_FIRST`` is returned once per tracker, for the first pass ever; passes after a
  sleep/wake cycle are plain ``HEALTHY``.
* A result recorded while paused (a probe that was already in flight when the task went
  to sleep) is discarded and reported as ``IGNORED_WHILE_PAUSED``.
* D5: a failure recorded with ``loading=True`` (the engine is inside its load window:
  launched or woken, no pass yet, and its load still judged by ``core.loading``) is
  reported as ``IGNORED_WHILE_LOADING`` and never counted: the load's progress decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

DEFAULT_START_PERIOD_S = 60.0
#: What an explicit ``start_period_seconds: 0`` means (a zero grace period would kill
#: every engine that is still loading its model).
ZERO_START_PERIOD_FALLBACK_S = 30.0
CHECK_TYPES = ("http", "tcp")

#: Dataclass attribute -> API field name.
_API_NAMES = {
    "type": "type",
    "path": "path",
    "port": "port",
    "interval_s": "interval_seconds",
    "timeout_s": "timeout_seconds",
    "unhealthy_threshold": "unhealthy_threshold",
    "start_period_s": "start_period_seconds",
}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _validate(values: Mapping[str, Any], names: Mapping[str, str]) -> None:
    """Raise ValueError naming the first bad field (named through ``names``)."""

    def bad(attr: str, problem: str) -> ValueError:
        return ValueError(f"health_check.{names.get(attr, attr)}: {problem}")

    kind = values["type"]
    if kind not in CHECK_TYPES:
        raise bad("type", f"must be one of {', '.join(CHECK_TYPES)}, got {kind!r}")
    path = values["path"]
    if not isinstance(path, str) or not path.startswith("/") or any(c.isspace() for c in path):
        raise bad("path", f"must start with '/' and contain no spaces, got {path!r}")
    port = values["port"]
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535
    ):
        raise bad("port", f"must be an integer in 1-65535, got {port!r}")
    for attr in ("interval_s", "timeout_s"):
        value = values[attr]
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise bad(attr, f"must be a number > 0, got {value!r}")
    threshold = values["unhealthy_threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise bad("unhealthy_threshold", f"must be an integer >= 1, got {threshold!r}")
    start = values["start_period_s"]
    if not _is_number(start) or not math.isfinite(start) or start < 0:
        raise bad("start_period_s", f"must be a number >= 0, got {start!r}")


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """A task's health-check settings. ``port`` is the CONTAINER port (None = the task's
    first container port); the agent maps it to the host port it probes."""

    type: str = "http"
    path: str = "/health"
    port: int | None = None
    interval_s: float = 10
    timeout_s: float = 3
    unhealthy_threshold: int = 3
    start_period_s: float = DEFAULT_START_PERIOD_S

    def __post_init__(self) -> None:
        _validate({f.name: getattr(self, f.name) for f in fields(self)}, {})

    @classmethod
    def from_api(cls, d: Mapping[str, Any] | None) -> HealthCheckConfig:
        """Build from the API's ``health_check`` JSON object.

        Fields: ``type, path, port, interval_seconds, timeout_seconds,
        unhealthy_threshold, start_period_seconds``; a missing or null field takes its
        default. ``start_period_seconds``: missing -> 60 s, 0 -> 30 s. Unknown fields and
        bad values raise ValueError naming the API field.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"health_check: must be an object, got {type(d).__name__}")
        by_api = {api: attr for attr, api in _API_NAMES.items()}
        unknown = sorted(set(d) - set(by_api))
        if unknown:
            raise ValueError(f"health_check.{unknown[0]}: unknown field "
                             f"(allowed: {', '.join(_API_NAMES.values())})")
        values: dict[str, Any] = {f.name: f.default for f in fields(cls)}
        values.update({by_api[k]: v for k, v in d.items() if v is not None})
        if values["start_period_s"] == 0 and _is_number(values["start_period_s"]):
            values["start_period_s"] = ZERO_START_PERIOD_FALLBACK_S
        _validate(values, _API_NAMES)
        for attr in ("interval_s", "timeout_s", "start_period_s"):
            values[attr] = float(values[attr])
        return cls(**values)


class HealthVerdict(StrEnum):
    """What one probe result means for the task."""

    HEALTHY_FIRST = "healthy_first"  # first pass ever: the task becomes routable
    HEALTHY = "healthy"
    IGNORED_IN_START_PERIOD = "ignored_in_start_period"  # failure: log it, do not count
    FAILING = "failing"  # counted failure, below the threshold
    UNHEALTHY = "unhealthy"  # threshold consecutive counted failures: fail the task
    IGNORED_WHILE_PAUSED = "ignored_while_paused"  # result arrived while sleeping
    IGNORED_WHILE_LOADING = "ignored_while_loading"  # failure inside a load window (D5)


class HealthTracker:
    """The health state of one task's container, driven by probe results."""

    def __init__(self, config: HealthCheckConfig, started_at: float) -> None:
        self.config = config
        self._period_start = started_at
        self._last_probe_at: float | None = None
        self._consecutive_failures = 0
        self._passed_once = False
        self._paused = False
        self._last_detail = ""

    @property
    def consecutive_failures(self) -> int:
        """Counted failures since the last pass (or reset)."""
        return self._consecutive_failures

    @property
    def last_detail(self) -> str:
        """The detail of the last recorded probe result."""
        return self._last_detail

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def passed_once(self) -> bool:
        """Whether any probe has passed (the task has been routable)."""
        return self._passed_once

    def in_start_period(self, now: float) -> bool:
        """Whether ``now`` lies inside the start period (container start or last resume)."""
        return now - self._period_start < self.config.start_period_s

    def due(self, now: float) -> bool:
        """Whether the next probe should run: never while paused; at once after start or
        resume; then every ``interval_s`` after the previous probe."""
        if self._paused:
            return False
        return self._last_probe_at is None or now - self._last_probe_at >= self.config.interval_s

    def record(
        self, ok: bool, now: float, detail: str = "", *, loading: bool = False
    ) -> HealthVerdict:
        """Record one probe result taken at ``now`` and say what it means; ``loading``:
        the engine is inside its load window (D5), a failure is not counted."""
        if self._paused:
            return HealthVerdict.IGNORED_WHILE_PAUSED
        self._last_probe_at = now
        self._last_detail = detail
        if ok:
            self._consecutive_failures = 0
            if not self._passed_once:
                self._passed_once = True
                return HealthVerdict.HEALTHY_FIRST
            return HealthVerdict.HEALTHY
        if self.in_start_period(now):
            return HealthVerdict.IGNORED_IN_START_PERIOD
        if loading:
            return HealthVerdict.IGNORED_WHILE_LOADING
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.config.unhealthy_threshold:
            return HealthVerdict.UNHEALTHY
        return HealthVerdict.FAILING

    def pause(self) -> None:
        """Stop judging (the task goes to sleep); the failure counter is cleared."""
        self._paused = True
        self._consecutive_failures = 0

    def resume(self, now: float) -> None:
        """Judge again (the task woke up at ``now``): counter cleared, start period
        restarted from ``now``, next probe due at once."""
        self._paused = False
        self._consecutive_failures = 0
        self._period_start = now
        self._last_probe_at = None
