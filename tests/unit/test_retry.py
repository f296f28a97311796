"""The C11 port-conflict back-off schedule."""

from __future__ import annotations

import pytest

from heteroflow.core.retry import Backoff


@pytest.mark.feature("C11")
def test_doubles_then_spends_the_rest_of_the_budget_then_gives_up() -> None:
    b = Backoff()  # 119 s
    elapsed, delays = 0.0, []
    attempt = 1
    while (d := b.next_delay(attempt, elapsed)) is not None:
        delays.append(d)
        elapsed += d
        attempt += 1
    assert delays == [1, 2, 4, 8, 16, 32, 56]
    assert sum(delays) == 119


@pytest.mark.feature("C11")
def test_small_budgets_are_respected() -> None:
    b = Backoff(total_s=2.5)
    assert b.next_delay(1, 0) == 1
    assert b.next_delay(2, 1) == 1.5  # capped by what is left
    assert b.next_delay(3, 2.5) is None
