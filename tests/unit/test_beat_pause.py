"""The agent's pause between heartbeats (agent/daemon.py ``beat_pause``): the interval
±10 %, so a fleet whose beats a stall of the server lined up spreads out again by itself
instead of hitting the server in one burst every interval."""

from __future__ import annotations

import random

import pytest

from heteroflow.agent.daemon import BEAT_JITTER, beat_pause


def test_the_pause_stays_within_a_tenth_of_the_interval() -> None:
    assert beat_pause(5.0, lambda: 0.0) == pytest.approx(4.5)
    assert beat_pause(5.0, lambda: 0.5) == pytest.approx(5.0)
    assert beat_pause(5.0, lambda: 1.0) == pytest.approx(5.5)
    rng = random.Random(3)
    pauses = [beat_pause(5.0, rng.random) for _ in range(10_000)]
    assert min(pauses) >= 4.5 and max(pauses) <= 5.5
    assert sum(pauses) / len(pauses) == pytest.approx(5.0, abs=0.02)  # the same rate
    assert BEAT_JITTER == 0.1


def busiest_second(beats: list[float]) -> int:
    """The most beats that fall in one second of the 5 s interval (phases mod 5 s)."""
    slots = [0] * 50
    for t in beats:
        slots[int((t % 5.0) * 10)] += 1
    return max(sum(slots[(i + k) % 50] for k in range(10)) for i in range(50))


def test_a_fleet_lined_up_by_a_stall_spreads_out_again() -> None:
    """1,000 agents answered within 0.1 s of each other (a stall that every beat waited
    through): with fixed pauses the whole fleet stays in one burst; with the jitter, a
    few minutes later no second of the interval carries much more than its share."""
    rng = random.Random(7)
    start = [rng.uniform(0.0, 0.1) for _ in range(1_000)]
    fixed, jittered = list(start), list(start)
    for _ in range(60):  # five minutes of beats
        fixed = [t + 5.0 for t in fixed]
        jittered = [t + beat_pause(5.0, rng.random) for t in jittered]
    assert busiest_second(fixed) == 1_000
    assert busiest_second(jittered) < 300  # an even spread puts 200 in each second
