"""``/metrics`` of ``heteroflow gateway --workers N`` (issue 31): the sum of every worker.

A scrape reaches whichever worker accepts its connection, so each worker's own counts
would be a random 1/N of the gateway. Prometheus's client has a multiprocess mode (a
file per process, summed when scraped); this is the same idea for the gateway's own
plain-dict metrics, with no per-request cost: each worker writes its counters to a file
of its own in a private directory (the parent's) once a second and when it stops, and
the worker that answers a scrape sums its live counters with the other files.

* Counters and histograms of a worker that has exited stay in the sum (its file stays):
  the total never goes down, which Prometheus would read as a counter reset. A worker
  killed outright loses at most its last second of counts.
* Gauges (requests in flight, requests held) count live workers only.
* The other workers' part is up to one second old (``interval_s``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from heteroflow.core.prometheus import Histogram
from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.workers import ProcessFiles

DEFAULT_INTERVAL_S = 1.0
_COUNTERS = (
    "requests",
    "tokens",
    "ejections",
    "failovers",
    "holds",
    "start_holds",
    "wakes",
    "fair_refusals",
)
_HISTOGRAMS = ("latency", "hold_seconds", "start_hold_seconds", "fair_waits")


class SharedMetrics:
    """One worker's side: write its own file; render the sum of all of them."""

    def __init__(
        self, directory: Path, metrics: GatewayMetrics, *, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        self._files = ProcessFiles(directory)
        self._metrics = metrics
        self._interval_s = interval_s

    def write(self) -> None:
        """This worker's counters to its file."""
        self._files.write(gateway_state(self._metrics))

    async def run(self, stop: asyncio.Event) -> None:
        await self._files.run(stop, lambda: gateway_state(self._metrics), self._interval_s)

    def render(self) -> bytes:
        return render_sum(self._metrics, self._files.others())


def render_sum(own: GatewayMetrics, others: list[tuple[Any, bool]]) -> bytes:
    """``own``'s series summed with the other workers' states (``gateway_state``; a
    worker that exited adds its counters and histograms, not its gauges)."""
    total = GatewayMetrics()
    _add(total, gateway_state(own), gauges=True)
    for state, alive in others:
        _add(total, state, gauges=alive)
    return total.render()


def gateway_state(m: GatewayMetrics) -> dict[str, Any]:
    state: dict[str, Any] = {name: getattr(m, name) for name in (*_COUNTERS, *_HISTOGRAMS)}
    state["in_flight"] = m.in_flight
    state["held"] = m.held
    state["fair_queue"] = m.fair_queue
    return state


def _add(total: GatewayMetrics, state: dict[str, Any], *, gauges: bool) -> None:
    for name in _COUNTERS:
        into: dict[Any, int] = getattr(total, name)
        for key, n in state.get(name, {}).items():
            into[key] = into.get(key, 0) + n
    for name in _HISTOGRAMS:
        hists: dict[str, Histogram] = getattr(total, name)
        for key, h in state.get(name, {}).items():
            mine = hists.get(key)
            if mine is None:
                hists[key] = h.copy()
                continue
            mine.add(h)
    if gauges:
        total.in_flight += state.get("in_flight", 0)
        for model, n in state.get("held", {}).items():
            total.held[model] = total.held.get(model, 0) + n
        for model, n in state.get("fair_queue", {}).items():
            total.fair_queue[model] = total.fair_queue.get(model, 0) + n

