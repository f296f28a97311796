"""Passive backend health (M5): pure state, no I/O, no logging.

A backend that failed a request (could not be reached, broke its answer, or answered
with a 5xx) is *ejected*: the balancer skips it for ``cooldown_s`` seconds, after which
it is restored by itself (lazily, on the next look-up; no timer runs). The gateway's
active probes (``gateway.probes``) use the same state: a failed probe ejects until the
next probe, a passing one restores at once. Only routing is affected; the task and its
container are left alone, since the agent's health checks decide about those.

Backends are keyed by ``base_url`` (the address that failed). The clock is injectable so
that unit tests need not sleep. Like the ``Balancer``, this is meant for one event loop
and is not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_COOLDOWN_S = 5.0
# Expired entries are dropped when looked up; this bounds what is never looked up again
# (backends that left the snapshot while ejected).
_MAX_ENTRIES = 10_000


class PassiveHealth:
    """Which backends are ejected from selection, and until when."""

    __slots__ = ("_clock", "_cooldown", "_until")

    def __init__(
        self,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cooldown = cooldown_s
        self._clock = clock
        self._until: dict[str, float] = {}  # base_url -> clock() deadline

    @property
    def cooldown_s(self) -> float:
        return self._cooldown

    def any_ejected(self) -> bool:
        """Cheap check for the hot path: False means no backend needs filtering.

        May answer True for entries whose cooldown has already run out; ``is_ejected``
        drops those.
        """
        return bool(self._until)

    def eject(self, base_url: str, seconds: float | None = None) -> bool:
        """Eject ``base_url`` for one cooldown (or ``seconds``) from now, never shortening
        a longer ejection; True if it was not ejected before."""
        until = self._until
        now = self._clock()
        fresh = until.get(base_url, now) <= now
        if fresh and len(until) >= _MAX_ENTRIES:
            for url in [u for u, t in until.items() if t <= now]:
                del until[url]
        deadline = now + (self._cooldown if seconds is None else seconds)
        if fresh or deadline > until[base_url]:
            until[base_url] = deadline
        return fresh

    def restore(self, base_url: str) -> bool:
        """End an ejection early (an active probe passed); True if it was ejected."""
        deadline = self._until.pop(base_url, None)
        return deadline is not None and deadline > self._clock()

    def is_ejected(self, base_url: str) -> bool:
        until = self._until
        if not until:
            return False
        deadline = until.get(base_url)
        if deadline is None:
            return False
        if self._clock() >= deadline:
            del until[base_url]  # restored
            return False
        return True
