"""The shared loop: call ``reconcile_once(now)`` every interval until stopped.

Controllers are level-triggered and idempotent, so a failed round is logged and the
next one simply tries again. Database work runs in a worker thread so the event loop
(which also serves the API and the gateway in the all-in-one) never blocks on it.

A controller declares ``leader_only``: True when it must run on one instance at a time
(its writes carry the lease's fencing epoch, see services/leadership.py), False when
every instance runs it. ``run_tick`` skips a leader-only controller on an instance that
does not hold the lease at that moment.

The leader-only lifecycle controllers share one skeleton, ``FencedController``: a round
asks the elector for its fencing token first (no token: ``LeaseLost``, nothing read or
written), then runs as of its tick, each of its transactions opened by ``Round`` with
``fenced(...)`` as the first statement. A subclass states its name, its interval (a
field the table fills from the settings) and ``round``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, Protocol, TypeVar

from sqlalchemy.orm import Session

from heteroflow.controllers.leadership import Leadership
from heteroflow.core.clock import Clock, interruptible_sleep
from heteroflow.db.engine import Database
from heteroflow.services.leadership import Fence, LeaseLost, fenced
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


class HoldsLease(Protocol):
    """What a leader-only controller needs of the elector (``Leadership``): the fencing
    token at ``now``, None when this instance does not lead then."""

    def fence(self, now: datetime) -> Fence | None: ...


@dataclass(frozen=True)
class Round:
    """One leader-only round as of ``now``, under the token ``fence``."""

    db: Database
    live: Clock  # the fence check uses the time it runs at, not the round's
    now: datetime
    fence: Fence

    @property
    def clock(self) -> FrozenClock:
        """The clock the round's services read: ``now()`` is the round's tick."""
        return FrozenClock(self.live, self.now)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A unit of work whose first statement is ``fenced(...)``: it is refused
        (``LeaseLost``, rolled back) once another instance took the lease over."""
        with self.db.session() as s:
            fenced(s, self.fence, self.live.now())
            yield s


R = TypeVar("R")


@dataclass(eq=False)
class FencedController(ABC, Generic[R]):
    """A leader-only controller: ``run_round`` checks the lease, then runs ``round``.

    Subclasses are ``@dataclass(eq=False, kw_only=True)`` and set ``name`` and
    ``skipped`` (what the ``LeaseLost`` of a follower's round says was skipped)."""

    name = ""
    skipped = ""
    leader_only = True

    db: Database
    clock: Clock
    leadership: HoldsLease
    interval_s: float = field(kw_only=True)

    def reconcile_once(self, now: datetime) -> None:
        self.run_round(now)

    def run_round(self, now: datetime | None = None) -> R:
        """One round as of ``now`` (default: the clock's); ``LeaseLost`` when this
        instance does not lead, and then nothing is read or written."""
        now = now or self.clock.now()
        fence = self.leadership.fence(now)
        if fence is None:
            raise LeaseLost(f"this instance does not lead: {self.skipped} skipped")
        return self.round(Round(self.db, self.clock, now, fence))

    @abstractmethod
    def round(self, r: Round) -> R:
        """The controller's work for one round (``r.transaction()`` for each write)."""


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
