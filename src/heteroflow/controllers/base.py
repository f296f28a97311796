"""The shared loop: call ``reconcile_once(now)`` every interval until stopped.

Controllers are level-triggered and idempotent, so a failed round is logged and the
next one simply tries again. Database work runs in a worker thread so the event loop
(which also serves the API and the gateway in the all-in-one) never blocks on it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from heteroflow.core.clock import Clock, interruptible_sleep

log = logging.getLogger(__name__)


class Controller(Protocol):
    name: str
    interval_s: float

    def reconcile_once(self) -> None: ...


async def run_loop(controller: Controller, clock: Clock, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.to_thread(controller.reconcile_once)
        except Exception:
            log.exception("%s round failed; retrying next interval", controller.name)
        if await interruptible_sleep(stop, controller.interval_s):
            return
