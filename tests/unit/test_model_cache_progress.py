"""A model download's progress (issue 29): rate over this download's own bytes, ETA from
what is left, listeners throttled by the injected clock and unable to break it."""

from __future__ import annotations

import pytest

from heteroflow.agent.model_cache import Progress
from heteroflow.agent.model_cache.download import Tracker
from heteroflow.core.clock import FakeClock


def test_rate_counts_fetched_bytes_only_and_eta_what_is_left() -> None:
    clock = FakeClock()
    t = Tracker("k", total=1000, done=300, clock=clock, interval_s=1.0)  # 300 resumed
    clock.advance(2.0)
    t.add(200)
    p = t.snapshot()
    assert (p.done_bytes, p.total_bytes) == (500, 1000)
    assert p.rate_bps == pytest.approx(100.0)
    assert p.eta_s == pytest.approx(5.0)


def test_unknown_total_or_no_time_yet_has_no_eta() -> None:
    clock = FakeClock()
    assert Tracker("k", None, 0, clock, 1.0).snapshot().eta_s is None
    t = Tracker("k", 10, 0, clock, 1.0)
    t.add(5)
    assert t.snapshot().rate_bps == 0.0 and t.snapshot().eta_s is None


def test_listeners_are_throttled_and_a_failing_one_is_contained() -> None:
    clock = FakeClock()
    t = Tracker("k", 100, 0, clock, interval_s=1.0)
    seen: list[Progress] = []

    def broken(_p: Progress) -> None:
        raise RuntimeError("a listener's bug")

    t.listeners += [broken, seen.append]
    for _ in range(10):
        t.add(1)  # all within one second: one report
    clock.advance(1.0)
    t.add(1)
    assert [p.done_bytes for p in seen] == [1, 11]
