"""GPU time's pure rules (N4): metered states, clipping and hour/day buckets, the sums."""

from __future__ import annotations

import typing
from datetime import UTC, date, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from heteroflow.core.metering import (
    RUNNING,
    SLEEPING,
    Meter,
    Unit,
    bucket_start,
    metered_state,
    pieces,
    span_refusal,
)
from heteroflow.core.states import TaskStatus

T = TaskStatus
MIN = 60_000_000  # microseconds in a minute


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 3, day, hour, minute, tzinfo=UTC)


@pytest.mark.feature("N4")
def test_metered_states() -> None:
    assert {s: metered_state(s) for s in TaskStatus} == {
        T.PENDING: None,
        T.SCHEDULED: RUNNING,  # placed: its cards are booked
        T.STARTING: RUNNING,
        T.RUNNING: RUNNING,
        T.WAKING: RUNNING,
        T.STOPPING: RUNNING,  # booked until the agent confirms the stop
        T.SLEEPING: SLEEPING,
        T.STOPPED: None,
        T.FAILED: None,
        T.COMPLETED: None,
    }


@pytest.mark.feature("N4")
def test_a_segment_across_day_and_hour_boundaries() -> None:
    # 22:30 on the 1st to 01:15 on the 2nd: 2 h 45 min
    start, end = at(1, 22, 30), at(2, 1, 15)
    assert pieces(start, end, lo=None, hi=at(9, 0), unit=None) == [(None, 165 * MIN)]
    assert pieces(start, end, lo=None, hi=at(9, 0), unit="hour") == [
        (at(1, 22), 30 * MIN),
        (at(1, 23), 60 * MIN),
        (at(2, 0), 60 * MIN),
        (at(2, 1), 15 * MIN),
    ]
    assert pieces(start, end, lo=None, hi=at(9, 0), unit="day") == [
        (at(1, 0), 90 * MIN),
        (at(2, 0), 75 * MIN),
    ]
    # clipped to [23:10, 00:40)
    assert pieces(start, end, lo=at(1, 23, 10), hi=at(2, 0, 40), unit="hour") == [
        (at(1, 23), 50 * MIN),
        (at(2, 0), 40 * MIN),
    ]
    # outside the range, or empty: nothing
    assert pieces(start, end, lo=at(2, 2), hi=at(3, 0), unit="hour") == []
    assert pieces(start, end, lo=None, hi=at(1, 22, 30), unit=None) == []
    assert pieces(end, end, lo=None, hi=at(9, 0), unit="day") == []


@pytest.mark.feature("N4")
def test_an_open_segment_runs_to_now() -> None:
    now = at(1, 10, 20)
    assert pieces(at(1, 9, 40), None, lo=None, hi=now, unit="hour") == [
        (at(1, 9), 20 * MIN),
        (at(1, 10), 20 * MIN),
    ]
    # a range's end before now caps it there
    assert pieces(at(1, 9, 40), None, lo=None, hi=at(1, 10), unit=None) == [(None, 20 * MIN)]


@pytest.mark.feature("N4")
def test_a_hand_computed_trace() -> None:
    """One card at 50 %: running 2 h, asleep 30 min, running again 15 min of which the
    report sees 10 (now); a TP-2 task (200) running 1 h beside it; a CPU task (0) 1 h."""
    now = at(1, 2, 55)
    segments = [
        (RUNNING, 50, at(1, 0), at(1, 2)),
        (SLEEPING, 50, at(1, 2), at(1, 2, 30)),
        (RUNNING, 50, at(1, 2, 45), None),
        (RUNNING, 200, at(1, 0), at(1, 1)),
        (RUNNING, 0, at(1, 0), at(1, 1)),
    ]
    total = Meter()
    per_hour: dict[datetime | None, Meter] = {}
    for state, pct, start, end in segments:
        for bucket, us in pieces(start, end, lo=None, hi=now, unit="hour"):
            total.add(state, pct, us)
            per_hour.setdefault(bucket, Meter()).add(state, pct, us)
    # running: 0.5 x 7200 + 0.5 x 600 + 2 x 3600 + 0; sleeping: 0.5 x 1800
    assert total.running_card_seconds == 3600 + 300 + 7200
    assert total.sleeping_card_seconds == 900
    assert total.running_task_seconds == 7200 + 600 + 3600 + 3600
    assert total.sleeping_task_seconds == 1800
    first, third = per_hour[at(1, 0)], per_hour[at(1, 2)]
    assert (first.running_card_seconds, first.running_task_seconds) == (1800 + 7200, 3 * 3600)
    assert (third.running_card_seconds, third.sleeping_card_seconds) == (300, 900)


@pytest.mark.feature("N4")
def test_sums_do_not_drift_and_round_to_the_millisecond() -> None:
    m = Meter()
    for _ in range(10):
        m.add(RUNNING, 100, 100_000)  # a tenth of a second, ten times
    assert m.running_card_seconds == 1.0 and m.running_task_seconds == 1.0
    m.add(SLEEPING, 33, 1_234_567)
    assert m.sleeping_card_seconds == 0.407  # 0.33 x 1.234567 = 0.40740711
    assert m.sleeping_task_seconds == 1.235
    other = Meter()
    other.merge(m)
    assert other == m
    with pytest.raises(ValueError, match="not a metered state"):
        m.add("pending", 100, 1)


@given(
    start=st.datetimes(
        min_value=datetime(2026, 1, 1), max_value=datetime(2026, 2, 1), timezones=st.just(UTC)
    ),
    length_us=st.integers(min_value=0, max_value=5 * 86_400_000_000),
    unit=st.sampled_from(typing.get_args(Unit)),
)
def test_buckets_add_up_to_the_whole(start: datetime, length_us: int, unit: Unit) -> None:
    end = start + timedelta(microseconds=length_us)
    got = pieces(start, end, lo=None, hi=end, unit=unit)
    assert sum(us for _, us in got) == length_us
    buckets = [b for b, _ in got if b is not None]
    assert len(buckets) == len(got) and buckets == sorted(set(buckets))
    assert all(bucket_start(b, unit) == b for b in buckets)


@pytest.mark.feature("N4")
def test_bucket_ranges_are_bounded() -> None:
    start = at(1, 0)
    assert span_refusal(None, start, None) is None
    assert span_refusal(start, start + timedelta(days=31), "hour") is None
    wide = span_refusal(start, start + timedelta(days=31, seconds=1), "hour")
    assert wide is not None and "at most 31 days" in wide
    assert span_refusal(start, start + timedelta(days=366), "day") is None
    assert span_refusal(start, start + timedelta(days=367), "day") is not None
    needs = span_refusal(None, start, "day")
    assert needs is not None and "needs a start" in needs
    # buckets are UTC, whatever zone the time came in: 01:30 on the 2nd at +02:00 is
    # 23:30 UTC on the 1st
    east = datetime(2026, 3, 2, 1, 30, tzinfo=timezone(timedelta(hours=2)))
    assert bucket_start(east, "day") == at(1, 0)
    assert bucket_start(east, "day").date() == date(2026, 3, 1)
    assert bucket_start(east, "hour") == at(1, 23)
