"""Passive backend ejection (M5): cooldown, automatic restore, injectable clock."""

from __future__ import annotations

import pytest

from heteroflow.gateway.routing.health import DEFAULT_COOLDOWN_S, PassiveHealth


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.feature("M5")
def test_ejected_for_the_cooldown_then_restored() -> None:
    clock = Clock()
    health = PassiveHealth(2.0, clock=clock)
    assert not health.any_ejected() and not health.is_ejected("http://a")
    assert health.eject("http://a") is True
    assert health.is_ejected("http://a") and not health.is_ejected("http://b")
    clock.now += 1.9
    assert health.is_ejected("http://a")
    clock.now += 0.1
    assert not health.is_ejected("http://a")
    assert not health.any_ejected()  # the expired entry was dropped on look-up


@pytest.mark.feature("M5")
def test_a_new_failure_extends_the_cooldown_and_is_not_fresh() -> None:
    clock = Clock()
    health = PassiveHealth(2.0, clock=clock)
    assert health.eject("http://a") is True
    clock.now += 1.5
    assert health.eject("http://a") is False  # already ejected: log once, not per failure
    clock.now += 1.5
    assert health.is_ejected("http://a")
    clock.now += 0.5
    assert not health.is_ejected("http://a")
    assert health.eject("http://a") is True  # fresh again after a restore


@pytest.mark.feature("M5")
def test_default_cooldown_is_five_seconds() -> None:
    assert DEFAULT_COOLDOWN_S == 5.0
    assert PassiveHealth().cooldown_s == 5.0
