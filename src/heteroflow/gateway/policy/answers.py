"""Answers per backend for the live series (issue 33): counted in memory, sent with the
load report (``BackendLoad.answered``, ``errors``, ``latency_ms``, ``ttft_ms``).

``done`` counts one relayed request (its status, arrival, first bytes and end, all
``time.monotonic()``; ``ended``: the request as it ended) and, per service, the requests
refused before a backend was chosen (``refused``); ``roll`` — at every usage flush, with
the tokens/s — takes the percentiles over the last ``WINDOW_S``. Counters run from the
gateway's start (the server takes their growth between two samples; a restarted gateway
has a new id). Errors (a status ≥ 400, or the client gone before the end:
``core.series.error_kind``) are counted by kind and left out of the percentiles. Memory
is bounded: at most ``SAMPLES`` timings per backend, whatever the request rate, and one
counter per service and error kind.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from heteroflow.core.series import error_kind, percentile

if TYPE_CHECKING:
    from heteroflow.gateway.inbound import Call

WINDOW_S = 30.0  # as the tokens/s (usage.TOKEN_WINDOW_S)
SAMPLES = 2048


class AnswerStats:
    def __init__(self) -> None:
        self._answered: dict[str, int] = {}  # task id -> answers since the gateway started
        self._errors: dict[str, dict[str, int]] = {}  # task id -> error kind -> count
        # task id -> (monotonic end, latency s, time to first bytes s or -1), last ones
        self._timings: dict[str, deque[tuple[float, float, float]]] = {}
        self._stats: dict[str, dict[str, Any]] = {}  # task id -> as of the last roll
        self._refused: dict[str, dict[str, int]] = {}  # group id -> error kind -> count

    def done(
        self, task_id: str, status: int, started: float, first_at: float, ended: float
    ) -> None:
        """A request relayed to backend ``task_id`` ended: arrival, the answer's first
        bytes (0: none), its end."""
        if not task_id:
            return
        self._answered[task_id] = self._answered.get(task_id, 0) + 1
        kind = error_kind(status)
        if kind is not None:
            errs = self._errors.setdefault(task_id, {})
            errs[kind] = errs.get(kind, 0) + 1
            return
        window = self._timings.get(task_id)
        if window is None:
            window = self._timings[task_id] = deque(maxlen=SAMPLES)
        ttft = first_at - started if first_at else -1.0
        window.append((ended, ended - started, ttft))

    def ended(self, call: Call, status: int, started: float, first_at: float) -> None:
        """A request ended now: counted on its backend once one was chosen (answered, or
        refused after: a limit, fair share), else on its route's service (refused while
        routing: no healthy backend, a hold that timed out, a capability it lacks); a
        request that named no route is nobody's."""
        if call.backend is not None:
            self.done(call.backend.task_id, status, started, first_at, time.monotonic())
        elif call.targets:
            self.refused(call.targets[0].group_id, status)

    def refused(self, group_id: str, status: int) -> None:
        """A request for ``group_id`` was refused before a backend was chosen."""
        kind = error_kind(status)
        if group_id and kind is not None:
            errs = self._refused.setdefault(group_id, {})
            errs[kind] = errs.get(kind, 0) + 1

    def refusals(self) -> dict[str, dict[str, int]]:
        """Per service, the refusals by kind since the gateway started (the report's
        ``refused``)."""
        return {g: dict(e) for g, e in self._refused.items()}

    def of(self, task_id: str) -> dict[str, Any]:
        """The load report's answer fields of one backend (``BackendLoad``), as of the
        last roll: counters since the gateway started, percentiles over the window."""
        return self._stats.get(task_id, {})

    def roll(self, now: float) -> None:
        """Close an interval at ``now`` (``time.monotonic()``): the window's percentiles."""
        for task_id in list(self._timings):
            window = self._timings[task_id]
            while window and window[0][0] <= now - WINDOW_S:
                window.popleft()
            if not window:
                del self._timings[task_id]
        stats: dict[str, dict[str, Any]] = {}
        for task_id, answered in self._answered.items():
            window = self._timings.get(task_id, deque())
            stats[task_id] = {
                "answered": answered,
                "errors": dict(self._errors.get(task_id, {})),
                "latency_ms": _ms(sorted(x[1] for x in window)),
                "ttft_ms": _ms(sorted(x[2] for x in window if x[2] >= 0)),
            }
        self._stats = stats


def _ms(sorted_s: list[float]) -> list[float] | None:
    """[p50, p95] in milliseconds of sorted seconds (None: no answer in the window)."""
    p50, p95 = percentile(sorted_s, 0.5), percentile(sorted_s, 0.95)
    if p50 is None or p95 is None:
        return None
    return [round(p50 * 1000, 1), round(p95 * 1000, 1)]
