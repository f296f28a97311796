"""M8 limits: the pure bucket / quota policy with time as a parameter, and the Limiter."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.policy import limits
from heteroflow.gateway.policy.limits import (
    OK,
    QUOTA,
    REQUESTS,
    TOKENS,
    Charge,
    KeyState,
    Limiter,
    Ticket,
    admit,
    format_duration,
    quota_period,
    rate_headers,
    refusal,
    request_cost,
    settle,
)
from heteroflow.gateway.routing.store import MemoryStore
from heteroflow.schemas.routing import KeyEntry, RoutingSnapshot

T0 = datetime(2026, 3, 31, 23, 0, tzinfo=UTC).timestamp() * 1000.0


def charge(
    rpm: int = 0,
    tpm: int = 0,
    quota: int = 0,
    kind: str = "day",
    cost: int = 0,
    now: float = T0,
) -> Charge:
    period, end = quota_period(kind, now) if quota else ("", 0.0)
    return Charge("ep", rpm, tpm, quota, period, end, min(cost, tpm) if tpm else cost, cost)


@pytest.mark.feature("M8")
def test_rpm_admits_exactly_the_limit_at_a_standstill_then_one_per_interval() -> None:
    st_ = KeyState.new()
    c = charge(rpm=30)
    verdicts = [admit(st_, c, T0).verdict for _ in range(60)]
    assert verdicts.count(OK) == 30 and verdicts[:30] == [OK] * 30
    refused = admit(st_, c, T0)
    assert refused.verdict == REQUESTS and refused.retry_after_ms == 2000  # 60 s / 30
    assert admit(st_, c, T0 + 1999).verdict == REQUESTS
    assert admit(st_, c, T0 + 2000).verdict == OK
    assert admit(st_, c, T0 + 2000).verdict == REQUESTS


@pytest.mark.feature("M8")
def test_an_odd_limit_is_exact_despite_floating_point() -> None:
    st_ = KeyState.new()
    c = charge(rpm=7)  # 60 s / 7 is not a round number of ms
    assert [admit(st_, c, T0).verdict for _ in range(8)].count(OK) == 7
    a = admit(st_, c, T0)
    assert admit(st_, c, T0 + a.retry_after_ms).verdict == OK


@pytest.mark.feature("M8")
def test_remaining_and_reset_describe_the_bucket_after_the_request() -> None:
    st_ = KeyState.new()
    c = charge(rpm=60, tpm=1000, cost=100)
    a = admit(st_, c, T0)
    assert (a.requests_remaining, a.requests_reset_ms) == (59, 1000)
    assert (a.tokens_remaining, a.tokens_reset_ms) == (900, 6000)
    headers = dict(rate_headers(c, a))
    assert headers == {
        b"x-ratelimit-limit-requests": b"60",
        b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"1s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"900",
        b"x-ratelimit-reset-tokens": b"6s",
    }
    # 30 s later half of a full minute's drain is back.
    b = admit(st_, charge(rpm=60, tpm=1000, cost=0), T0 + 30_000)
    assert b.requests_remaining == 59 and b.tokens_remaining == 1000


@pytest.mark.feature("M8")
def test_a_refused_request_takes_nothing_from_any_limit() -> None:
    st_ = KeyState.new()
    assert admit(st_, charge(rpm=10, tpm=100, cost=80), T0).verdict == OK
    refused = admit(st_, charge(rpm=10, tpm=100, cost=30), T0)
    assert refused.verdict == TOKENS
    assert refused.retry_after_ms == 6000  # 10 tokens over, at 100 per minute
    # the refused request took no RPM either: 9 requests of cost <= 20 still fit... by RPM
    assert admit(st_, charge(rpm=10, tpm=100, cost=20), T0).verdict == OK
    assert st_.requests.level == 2


@pytest.mark.feature("M8")
def test_tpm_reservation_is_corrected_by_the_real_usage_both_ways() -> None:
    st_ = KeyState.new()
    c = charge(tpm=1000, cost=600)
    assert admit(st_, c, T0).verdict == OK
    assert admit(st_, charge(tpm=1000, cost=600), T0).verdict == TOKENS
    settle(st_, c, 50 - 600, 0, T0)  # the answer used 50
    assert admit(st_, charge(tpm=1000, cost=600), T0).verdict == OK  # 650 taken
    # An answer bigger than its reservation is charged too: the bucket goes over the
    # limit (the documented overshoot) and nothing passes until it drained back.
    settle(st_, c, 900, 0, T0)
    assert st_.tokens.level == pytest.approx(1550)
    refused = admit(st_, charge(tpm=1000, cost=1), T0)
    assert refused.verdict == TOKENS and refused.retry_after_ms == 33_060


@pytest.mark.feature("M8")
def test_a_request_larger_than_the_whole_tpm_is_capped_and_waits_for_a_full_bucket() -> None:
    st_ = KeyState.new()
    big = charge(tpm=100, cost=5000)
    assert big.tokens_cost == 100
    assert admit(st_, big, T0).verdict == OK
    assert admit(st_, big, T0 + 59_999).verdict == TOKENS
    assert admit(st_, big, T0 + 60_000).verdict == OK


@pytest.mark.feature("M8")
def test_quota_breaker_opens_when_spent_and_closes_at_the_utc_period_end() -> None:
    st_ = KeyState.new()
    c = charge(quota=100, kind="day", cost=60)
    assert admit(st_, c, T0).verdict == OK
    assert admit(st_, c, T0).verdict == OK  # 60 < 100: passes, overshoots to 120
    refused = admit(st_, c, T0)
    assert refused.verdict == QUOTA and refused.used == 120
    assert refused.retry_after_ms == 3_600_000  # 23:00 -> midnight UTC
    err = refusal(c, refused)
    assert (err.status, err.type, err.code) == (429, "insufficient_quota", "insufficient_quota")
    assert "2026-04-01T00:00:00Z" in err.message
    nxt = T0 + 3_600_000
    assert admit(st_, charge(quota=100, kind="day", cost=60, now=nxt), nxt).verdict == OK
    assert st_.used == 60 and st_.period == "d20260401"


@pytest.mark.feature("M8")
def test_settling_the_quota_returns_the_unused_reservation_within_the_period() -> None:
    st_ = KeyState.new()
    c = charge(quota=100, cost=90)
    assert admit(st_, c, T0).verdict == OK
    settle(st_, c, 0, 10 - 90, T0)
    assert st_.used == 10
    # a correction for an earlier period does not touch the new one
    nxt = T0 + 3_600_000
    assert admit(st_, charge(quota=100, cost=5, now=nxt), nxt).verdict == OK
    settle(st_, c, 0, -90, nxt)
    assert st_.used == 5


@pytest.mark.feature("M8")
@pytest.mark.parametrize(
    ("kind", "now", "pid", "end"),
    [
        ("day", datetime(2026, 3, 31, 23, 59, 59, tzinfo=UTC), "d20260331", datetime(2026, 4, 1)),
        ("month", datetime(2026, 1, 31, 12, tzinfo=UTC), "m202601", datetime(2026, 2, 1)),
        ("month", datetime(2026, 12, 1, tzinfo=UTC), "m202612", datetime(2027, 1, 1)),
        ("month", datetime(2028, 2, 29, 23, tzinfo=UTC), "m202802", datetime(2028, 3, 1)),
    ],
)
def test_quota_periods_are_utc_calendar_periods(
    kind: str, now: datetime, pid: str, end: datetime
) -> None:
    got_id, got_end = quota_period(kind, now.timestamp() * 1000)
    assert got_id == pid
    assert got_end == end.replace(tzinfo=UTC).timestamp() * 1000


@pytest.mark.feature("M8")
def test_request_cost_estimates_prompt_plus_output_times_n() -> None:
    chat = "/v1/chat/completions"
    assert request_cost(chat, {"max_tokens": 100}, 400) == 200
    assert request_cost(chat, {"max_completion_tokens": 10, "max_tokens": 100}, 40) == 20
    assert request_cost(chat, {"max_tokens": 10, "n": 3}, 40) == 40
    assert request_cost(chat, {}, 40) == 10 + limits.DEFAULT_MAX_TOKENS[chat]
    assert request_cost("/v1/completions", {"max_tokens": True}, 4) == 1 + 16
    assert request_cost("/v1/embeddings", {"max_tokens": 100}, 41) == 11


@pytest.mark.feature("M8")
@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0ms"),
        (120, "120ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (59_999, "59.999s"),
        (360_000, "6m0s"),
        (3_661_000, "61m1s"),
    ],
)
def test_reset_durations_are_spelled_like_openai(ms: int, text: str) -> None:
    assert format_duration(ms) == text


@pytest.mark.feature("M8")
@pytest.mark.feature("M12")
def test_refusals_are_openai_shaped() -> None:
    st_ = KeyState.new()
    c = charge(rpm=1)
    admit(st_, c, T0)
    a = admit(st_, c, T0)
    err = refusal(c, a)
    assert (err.status, err.type, err.code) == (429, "requests", "rate_limit_exceeded")
    assert "Limit 1, Used 1, Requested 1" in err.message and "60s" not in err.message
    headers = dict(limits.refusal_headers(c, a))
    assert headers[b"retry-after"] == b"60" and headers[b"retry-after-ms"] == b"60000"
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(1, 50),
    steps=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20)), max_size=80),
)
@pytest.mark.feature("M8")
def test_a_bucket_never_admits_more_than_limit_plus_the_drain(
    limit: int, steps: list[tuple[int, int]]
) -> None:
    """Over [0, t], admitted cost <= limit + t * limit / 60 s (the token-bucket bound)."""
    st_ = KeyState.new()
    now, admitted = T0, 0
    for advance, cost in steps:
        now += advance
        c = Charge("ep", 0, limit, 0, "", 0.0, min(cost, limit), cost)
        if admit(st_, c, now).verdict == OK:
            admitted += c.tokens_cost
        assert admitted <= limit + (now - T0) * limit / 60_000 + 1e-6


def _entry(**kw: int | str) -> KeyEntry:
    return KeyEntry("ep-1", "t-1", None, frozenset({"m"}), **kw)  # type: ignore[arg-type]


@pytest.mark.feature("M8")
def test_limiter_refunds_failures_keeps_unknown_usage_and_settles_known_usage() -> None:
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    store = MemoryStore()
    limiter = Limiter(store, clock)
    entry = _entry(tpm_limit=1000)
    body = {"max_tokens": 396}
    run = asyncio.run

    def take() -> Ticket:
        t = run(limiter.admit(entry, "/v1/chat/completions", body, 16))
        assert isinstance(t, Ticket)
        return t

    t = take()
    assert t.charge.tokens_cost == 400 and t.admission.tokens_remaining == 600
    limiter.settle(t, 502, None)  # nothing generated: all back
    t = take()
    assert t.admission.tokens_remaining == 600
    limiter.settle(t, 200, None)  # usage unknown: the reservation stays
    t = take()
    assert t.admission.tokens_remaining == 200
    limiter.settle(t, 200, 100)  # real usage 100 of 400 reserved: 300 back
    t = take()
    assert t.admission.tokens_remaining == 100
    refused = run(limiter.admit(entry, "/v1/chat/completions", body, 16))
    assert not isinstance(refused, Ticket)
    err, headers = refused
    assert err.code == "rate_limit_exceeded" and err.type == "tokens"
    assert dict(headers)[b"x-ratelimit-remaining-tokens"] == b"100"


@pytest.mark.feature("M8")
def test_limiter_quota_uses_the_period_of_the_injected_clock() -> None:
    clock = FakeClock(datetime(2026, 1, 31, 23, 59, tzinfo=UTC))
    limiter = Limiter(MemoryStore(), clock)
    entry = _entry(quota_tokens=10, quota_period="month")
    t = asyncio.run(limiter.admit(entry, "/v1/embeddings", {}, 40))
    assert isinstance(t, Ticket) and t.charge.period == "m202601"
    refused = asyncio.run(limiter.admit(entry, "/v1/embeddings", {}, 40))
    assert not isinstance(refused, Ticket) and refused[0].code == "insufficient_quota"
    assert dict(refused[1])[b"retry-after"] == b"60"
    clock.advance(60)
    t = asyncio.run(limiter.admit(entry, "/v1/embeddings", {}, 40))
    assert isinstance(t, Ticket) and t.charge.period == "m202602"


@pytest.mark.feature("M8")
def test_a_quota_without_a_valid_period_is_no_quota() -> None:
    limiter = Limiter(MemoryStore(), FakeClock())
    entry = _entry(quota_tokens=1, quota_period="week")
    for _ in range(3):
        assert isinstance(asyncio.run(limiter.admit(entry, "/v1/embeddings", {}, 40)), Ticket)


@pytest.mark.feature("M8")
def test_key_limits_travel_in_the_snapshot_and_old_payloads_parse() -> None:
    snap = RoutingSnapshot(
        version=3,
        keys={"h": _entry(rpm_limit=5, tpm_limit=6, quota_tokens=7, quota_period="day")},
    )
    back = RoutingSnapshot.from_wire(snap.to_wire())
    assert back.keys["h"] == snap.keys["h"]
    old = snap.to_wire()
    for k in ("rpm_limit", "tpm_limit", "quota_tokens", "quota_period"):
        del old["keys"]["h"][k]
    e = RoutingSnapshot.from_wire(old).keys["h"]
    assert (e.rpm_limit, e.tpm_limit, e.quota_tokens, e.quota_period) == (0, 0, 0, "")
