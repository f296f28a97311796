"""The login back-off rule and the token-age rule (core/auth_policy.py): pure functions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from heteroflow.core.auth_policy import (
    FREE_FAILURES,
    LoginBackoff,
    backoff_s,
    first_valid_iat,
    retry_after_s,
)


def test_five_failures_are_free_then_the_block_doubles_up_to_the_cap() -> None:
    rule = LoginBackoff(base_s=1.0, max_s=900.0)
    assert FREE_FAILURES == 5
    assert [rule.block_s(f) for f in range(5)] == [0.0] * 5
    assert [rule.block_s(f) for f in range(5, 11)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert rule.block_s(14) == 512.0
    assert rule.block_s(15) == 900.0  # 1024 s, capped at 15 minutes
    assert rule.block_s(16) == 900.0


@pytest.mark.parametrize("failures", [69, 1_100, 10**9])
def test_a_huge_count_is_the_cap_not_an_overflow(failures: int) -> None:
    assert backoff_s(failures, base_s=3.0, max_s=900.0) == 900.0


def test_base_scales_the_whole_ladder() -> None:
    assert [backoff_s(f, base_s=0.5, max_s=60.0) for f in (4, 5, 6, 12)] == [0.0, 0.5, 1.0, 60.0]


def test_a_quiet_key_is_forgotten_after_forget_s() -> None:
    now = datetime(2026, 1, 2, tzinfo=UTC)
    rule = LoginBackoff(forget_s=3600.0)
    assert rule.forget_before(now) == now - timedelta(hours=1)


def test_retry_after_rounds_up_and_is_at_least_one_second() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert retry_after_s(now + timedelta(seconds=4.2), now) == 5
    assert retry_after_s(now + timedelta(seconds=4), now) == 4
    assert retry_after_s(now + timedelta(milliseconds=1), now) == 1


def test_tokens_of_the_revocation_second_are_refused() -> None:
    assert first_valid_iat(None) == 0
    t = datetime(2026, 1, 1, 0, 0, 10, 500_000, tzinfo=UTC)
    assert first_valid_iat(t) == int(t.timestamp()) + 1  # iat 10 s (before or after .5) is out
    whole = datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)
    assert first_valid_iat(whole) == int(whole.timestamp()) + 1
