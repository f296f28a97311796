"""The wake retrier is leader-only: without the lease it writes nothing (F3)."""

from __future__ import annotations

from datetime import datetime

import pytest

from heteroflow.controllers.wakes import WakeRetrier
from heteroflow.core.clock import FakeClock
from heteroflow.services.leadership import Fence, LeaseLost


class NotLeader:
    def fence(self, now: datetime) -> Fence | None:
        return None


class NoDatabase:
    def session(self) -> None:
        raise AssertionError("a follower must not open a unit of work")


def test_a_follower_skips_the_round_before_touching_the_database() -> None:
    retrier = WakeRetrier(
        NoDatabase(),  # type: ignore[arg-type]
        FakeClock(),
        NotLeader(),
        interval_s=2.0,
        offline_after_s=20.0,
        node_lost_after_s=120.0,
    )
    assert retrier.leader_only and retrier.interval_s == 2.0
    with pytest.raises(LeaseLost, match="wake retrier skipped"):
        retrier.reconcile_once(FakeClock().now())
