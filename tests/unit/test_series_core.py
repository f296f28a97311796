"""The live series' store (issue 33, core/series.py): the bound and the downsampling,
on a fake clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.core.series import (
    MAX_POINT_BYTES,
    MAX_POINTS_PER_SERIES,
    MINUTE_STEP_S,
    RAW_STEP_S,
    SERVICE_METRICS,
    Point,
    SeriesBook,
    bucket,
    error_kind,
    merge,
    percentile,
    point_bytes,
    public,
    resample,
)

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def _full(i: int, t: int) -> dict[str, float | None]:
    return {m: 123456.789012 + i + t / 7 for m in SERVICE_METRICS}


def test_100_services_for_25_hours_stay_within_the_bound() -> None:
    clock = FakeClock(T0)
    book = SeriesBook()
    services = [f"grp-{i:04d}" for i in range(100)]
    seconds = 25 * 3600
    # every metric set, with long fractional values (the worst case for the bytes)
    sample = {("service", key): _full(i, 0) for i, key in enumerate(services)}
    for t in range(0, seconds, RAW_STEP_S):
        now = clock.now()
        book.add_sample(now, sample)
        if t % 60 == 50:
            book.prune(now)
        clock.advance(RAW_STEP_S)
    book.prune(clock.now())
    per_series = MAX_POINTS_PER_SERIES  # 360 raw + 1440 minute points
    assert per_series == 1800
    # one round's points past the cut at most (the prune runs each round)
    assert book.count() <= 100 * (per_series + 2)
    assert book.count() >= 100 * (per_series - 2)  # and it did keep 24 h, not less
    raw = book.points("service", "grp-0000", RAW_STEP_S)
    minutes = book.points("service", "grp-0000", MINUTE_STEP_S)
    assert raw[-1].at - raw[0].at <= timedelta(hours=1)
    assert timedelta(hours=23, minutes=58) <= minutes[-1].at - minutes[0].at <= timedelta(hours=24)
    # the bytes: every point within MAX_POINT_BYTES, the whole within the documented bound
    stored = book.bytes()
    assert stored <= book.count() * MAX_POINT_BYTES
    # the documented cost (docs/api.md): at most 1.7 MB of values per service-day by
    # construction; ~0.76 MB measured here with every metric at 12 significant digits
    assert MAX_POINT_BYTES * per_series < 1_700_000
    assert stored / 100 < 800_000


def test_a_minute_point_is_the_mean_of_its_raw_samples() -> None:
    book = SeriesBook()
    for k, v in enumerate([1.0, 2.0, 3.0, 4.0, 5.0, 9.0]):
        book.add("service", "g", T0 + timedelta(seconds=10 * k), {"requests_per_s": v,
                 "queue": None if k % 2 else float(k)})
    (minute,) = book.points("service", "g", MINUTE_STEP_S)
    assert minute.at == T0
    assert minute.values["requests_per_s"] == pytest.approx(4.0)
    assert minute.values["queue"] == pytest.approx((0 + 2 + 4) / 3)  # missing: not counted
    assert "#queue" not in minute.values  # counts are not public
    assert len(book.points("service", "g", RAW_STEP_S)) == 6


def test_merge_is_a_running_mean_that_a_new_leader_can_continue() -> None:
    first = merge(None, {"in_flight": 2.0})
    again = merge(dict(first), {"in_flight": 4.0})  # read back from storage by another
    assert public(again) == {"in_flight": 3.0}
    assert again["#"] == 2 and "#in_flight" not in again  # in every sample: one count
    # a metric missing from some samples keeps its own count
    m = merge(None, {"a": 1.0})
    m = merge(m, {"a": 3.0, "b": 4.0})
    m = merge(m, {"a": 5.0})
    m = merge(m, {"a": 7.0, "b": 8.0})
    assert public(m) == {"a": 4.0, "b": 6.0}
    assert (m["#"], m["#b"]) == (4, 2) and "#a" not in m


def test_unknown_metrics_and_non_numbers_are_not_stored() -> None:
    book = SeriesBook()
    book.add("service", "g", T0, {"requests_per_s": 1.0, "bogus": 5.0,
                                  "queue": float("nan")})
    (p,) = book.points("service", "g", RAW_STEP_S)
    assert p.values == {"requests_per_s": 1.0}


def test_resample_averages_into_coarser_buckets() -> None:
    pts = [Point(T0 + timedelta(seconds=10 * k), {"x": float(k)}) for k in range(12)]
    out = resample(pts, 30, ["x"])
    assert [p.at for p in out] == [T0 + timedelta(seconds=30 * k) for k in range(4)]
    assert [p.values["x"] for p in out] == [1.0, 4.0, 7.0, 10.0]


def test_helpers() -> None:
    assert bucket(T0 + timedelta(seconds=67), 60) == T0 + timedelta(seconds=60)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.95) == 4.0
    assert percentile([], 0.5) is None
    assert [error_kind(s) for s in (200, 0, 429, 404, 503)] == [
        None, "client_left", "429", "4xx", "5xx"]
    assert point_bytes({"a": 1.5}) == len('{"a":1.5}')
