"""The shared loop: call ``reconcile_once(now)`` every interval until stopped.

Controllers are level-triggered and idempotent, so a failed round is logged and the
next one simply tries again. Database work runs in a worker thread so the event loop
(which also serves the API and the gateway in the all-in-one) never blocks on it.

A controller declares ``leader_only``: True when it must run on one instance at a time
(its writes carry the lease's fencing epoch, see services/leadership.py), False when
every instance runs it. ``run_tick`` skips a leader-only controller on an instance that
does not hold the lease at that moment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import Protocol

from heteroflow.controllers.leadership import Leadership
from heteroflow.core.clock import Clock, interruptible_sleep
from heteroflow.services.leadership import LeaseLost
from heteroflow.services.metrics import ServerMetrics

log = logging.getLogger(__name__)


class Controller(Protocol):
    name: str
    interval_s: float
    leader_only: bool

    def reconcile_once(self, now: datetime) -> None: ...


class FrozenClock:
    """``clock`` with ``now()`` fixed at one instant: a round runs "as of" its tick."""

    def __init__(self, clock: Clock, now: datetime) -> None:
        self._clock = clock
        self._now = now

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._clock.monotonic()


def run_tick(
    controller: Controller,
    leadership: Leadership,
    now: datetime,
    metrics: ServerMetrics | None = None,
) -> bool:
    """One round if this instance may run it at ``now``; True when it ran (even if it
    failed: the failure is logged and the next round tries again). ``metrics`` counts
    the rounds that ran, their time and their failures (P3)."""
    if controller.leader_only and not leadership.is_leader(now):
        return False
    error: str | None = None
    start = time.perf_counter()
    try:
        controller.reconcile_once(now)
    except LeaseLost as exc:  # lost between the check above and the write: refused
        log.warning("%s round refused: %s", controller.name, exc)
        error = "lease_lost"
    except Exception:
        log.exception("%s round failed; retrying next interval", controller.name)
        error = "exception"
    if metrics is not None:
        metrics.controller_round(controller.name, time.perf_counter() - start, error)
    return True


async def run_loop(
    controller: Controller,
    clock: Clock,
    stop: asyncio.Event,
    leadership: Leadership,
    metrics: ServerMetrics | None = None,
) -> None:
    while not stop.is_set():
        await asyncio.to_thread(run_tick, controller, leadership, clock.now(), metrics)
        if await interruptible_sleep(stop, controller.interval_s):
            return
