"""The scheduler loop (every ``scheduler_interval_s``, default 1 s)."""

from __future__ import annotations

import logging

from heteroflow.core.clock import Clock
from heteroflow.core.placement import Policy, Reservation
from heteroflow.db.engine import Database
from heteroflow.services.scheduling import RoundResult, schedule_round

log = logging.getLogger(__name__)


class Scheduler:
    name = "scheduler"

    def __init__(
        self,
        db: Database,
        clock: Clock,
        *,
        interval_s: float,
        offline_after_s: float,
        port_pool: range,
        reservation: Reservation | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.interval_s = interval_s
        self.offline_after_s = offline_after_s
        self.port_pool = port_pool
        self.reservation = reservation or Reservation()
        self.policy = policy or Policy()

    def reconcile_once(self) -> None:
        self.run_round()

    def run_round(self) -> RoundResult:
        with self.db.session() as s:
            result = schedule_round(
                s,
                self.clock,
                offline_after_s=self.offline_after_s,
                reservation=self.reservation,
                port_pool=self.port_pool,
                policy=self.policy,
            )
        if result.placed:
            log.info("scheduler placed %d task(s); %d waiting", result.placed, result.unplaced)
        return result
