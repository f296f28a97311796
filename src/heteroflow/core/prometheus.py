"""Prometheus text exposition (format 0.0.4), written by hand (P3).

The server's and the agents' ``/metrics`` render with this, the way the gateway's
``gateway/metrics.py`` does: counts live in plain dicts, the text is built only when
scraped, no client library (a count is a dict update). Pure: no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
Labels = Mapping[str, str]


class Histogram:
    """Observations counted per bucket (upper bounds ``bounds``, then +Inf)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (the last is +Inf), not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def copy(self) -> Histogram:
        h = Histogram(self.bounds)
        h.counts, h.count, h.sum = list(self.counts), self.count, self.sum
        return h

    def add(self, other: Histogram) -> None:
        """Count ``other``'s observations here too (same bounds: another process's)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.count += other.count
        self.sum += other.sum


class Exposition:
    """Families and their samples, in the order written; ``render`` gives the body."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, labels: Labels | None = None) -> None:
        self._lines.append(f"{name}{_labels(labels)} {number(value)}")

    def histogram(self, name: str, h: Histogram, labels: Labels | None = None) -> None:
        base = dict(labels or {})
        cumulative = 0
        for bound, n in zip(h.bounds, h.counts, strict=False):
            cumulative += n
            self._lines.append(f"{name}_bucket{_labels({**base, 'le': str(bound)})} {cumulative}")
        self._lines.append(f"{name}_bucket{_labels({**base, 'le': '+Inf'})} {h.count}")
        self._lines.append(f"{name}_sum{_labels(base)} {number(h.sum)}")
        self._lines.append(f"{name}_count{_labels(base)} {h.count}")

    def render(self) -> bytes:
        return ("\n".join(self._lines) + "\n").encode() if self._lines else b""


def number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels | None) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"
