"""The scheduler loop (every ``scheduler_interval_s``, default 1 s) and its worker pool.

One worker runs one round over the whole queue (up to ``round_limit`` tasks). With
``workers`` > 1 on PostgreSQL, each worker runs rounds of ``worker_chunk`` tasks in its
own thread and session; ``FOR UPDATE SKIP LOCKED`` hands them disjoint tasks and the
nodes' booking CAS keeps their cards apart (see services.scheduling). Placement is CPU
work under the GIL, so more workers buy overlap with database round trips, not more
cores; several server instances are the way to more cores. SQLite has one writer:
there the pool is one worker.

Every instance runs it (``leader_only = False``): the same ``SKIP LOCKED`` claim and
booking compare-and-set that keep a pool's workers apart keep several instances' rounds
apart, so more instances are more placement throughput and no failover gap.

A round runs with Python's cyclic garbage collector paused (``gc_paused``). A round at
10,000 nodes holds ~340,000 objects the collector tracks (node and card views, rows,
decisions) that live exactly as long as the round; the collector saw them survive and
ran full collections of the whole heap over and over (a third of the round's time, in
pauses of 65-380 ms). They are freed by reference counting when the round returns;
cycles, if any, are left to the next ordinary collection. With a worker pool the pause
lasts while rounds overlap, i.e. while the queue drains, never across ticks.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime

from heteroflow.core.clock import Clock
from heteroflow.core.placement import Policy, Reservation
from heteroflow.db.engine import Database
from heteroflow.services.placement.scheduling import RoundResult, schedule_round

log = logging.getLogger(__name__)


class _GcPause:
    """Process-wide (the collector is): the first round in pauses it, the last one out
    restores it as it found it, so a pool's overlapping rounds nest safely."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()


gc_paused = _GcPause()


class Scheduler:
    name = "scheduler"
    leader_only = False

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
        workers: int = 1,
        round_limit: int = 10_000,
        worker_chunk: int = 1_000,
    ) -> None:
        self.db = db
        self.clock = clock
        self.interval_s = interval_s
        self.offline_after_s = offline_after_s
        self.port_pool = port_pool
        self.reservation = reservation or Reservation()
        self.policy = policy or Policy()
        pg = db.engine.dialect.name == "postgresql"
        self.workers = workers if pg else 1
        self.round_limit = round_limit
        self.worker_chunk = worker_chunk
        self.on_round: Callable[[RoundResult], None] | None = None  # metrics (P3)

    def reconcile_once(self, now: datetime) -> None:
        # placement reads the injected clock itself: a pool's rounds may span a while
        if self.workers == 1:
            self.run_round()
            return
        with ThreadPoolExecutor(self.workers, thread_name_prefix="scheduler") as pool:
            for f in [pool.submit(self._drain) for _ in range(self.workers)]:
                f.result()

    def _drain(self) -> RoundResult:
        """A pool worker: rounds of ``worker_chunk`` until one places nothing."""
        total = RoundResult(0, 0)
        while True:
            r = self.run_round(limit=self.worker_chunk)
            total.placed += r.placed
            total.preempted += r.preempted
            total.conflicts += r.conflicts
            total.decision_ms.extend(r.decision_ms)
            if r.placed == 0 and r.conflicts == 0:
                total.unplaced = r.unplaced
                return total

    def run_round(self, limit: int | None = None) -> RoundResult:
        with gc_paused(), self.db.session() as s:
            result = schedule_round(
                s,
                self.clock,
                offline_after_s=self.offline_after_s,
                reservation=self.reservation,
                port_pool=self.port_pool,
                policy=self.policy,
                limit=limit or self.round_limit,
            )
        if result.placed or result.preempted:
            log.info(
                "scheduler placed %d task(s), preempted %d; %d waiting",
                result.placed, result.preempted, result.unplaced,
            )
        if self.on_round is not None:
            self.on_round(result)
        return result
