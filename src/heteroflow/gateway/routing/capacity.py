"""What each backend's work costs, learned from its answers (M15 ``capacity``): pure.

The ``capacity`` balancing algorithm (``balancing``) sends a request to the backend with
the lowest expected completion cost, ``(in flight + 1) x seconds per token`` — Finagle's
and Linkerd's peak-EWMA idea (pending requests times a decaying latency estimate) with
the latency made per token. This module keeps the *seconds per token* of each backend.

The signal: every answered request whose usage is known (streams included: the gateway
asks for a stream's usage, M7) adds its duration — from the send that was answered to
the end of the relayed answer — and its completion tokens to two decaying sums, and the
estimate is their ratio, ``Σ seconds / Σ tokens``. Why this one:

* Per *token*, not per request: a replica that got the long answers is not mistaken for
  a slow one. The ratio of sums (not a mean of per-request ratios) weighs each request
  by its tokens, so a one-token answer whose time is mostly its prompt's prefill counts
  as one token, not as one request as heavy as a 500-token one.
* Latency, not throughput: tokens/s while busy rises with concurrency on an engine that
  batches (a GPU), so the busiest replica would look the most capable and draw still more
  (positive feedback); seconds per token only ever rises with load, so the cost's
  feedback is negative and the split is stable. It is measured at the concurrency the
  replica ran at, so it already holds its engine queue and its batch: a separate engine
  queue or KV term would count them twice.
* It needs nothing but what the gateway sees (no scrape, any engine, external backends
  included).

Decay: both sums are multiplied by ``exp(-Δt / tau_s)`` at each observation, so the
estimate follows the last ``tau_s`` (10 s) of answers whatever the request rate, and a
replica that changed (throttled, recovered, another card) is relearned within a few
``tau_s`` of traffic. An estimate with no observation for ``stale_s`` (30 s) is
forgotten: a replica that looked slow once and so got nothing since would otherwise
never be tried again; a forgotten or new backend counts at the route's mean of the
others (``balancing``), so it is tried at once and never starved at a cold start.

Estimates are per gateway process (each worker of ``--workers N`` learns from its own
answers, which are a fair sample of the same replicas); in-flight counts are shared.
The view is not thread-safe: one event loop, as ``Balancer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

DEFAULT_TAU_S = 10.0
DEFAULT_STALE_S = 30.0
# Backends of routes that no longer exist are dropped wholesale past this many entries
# (relearning costs a few requests; unbounded growth over months of churn does not).
_MAX_ENTRIES = 10_000


class _Estimate:
    """Decaying sums of one backend's answers; ``spt`` is their ratio."""

    __slots__ = ("at", "seconds", "spt", "tokens")

    def __init__(self, at: float, seconds: float, tokens: float) -> None:
        self.at = at
        self.seconds = seconds
        self.tokens = tokens
        self.spt = seconds / tokens


class CapacityView:
    """Seconds per completion token per backend (base URL), decaying with time."""

    __slots__ = ("_clock", "_estimates", "_stale_s", "_tau_s")

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        tau_s: float = DEFAULT_TAU_S,
        stale_s: float = DEFAULT_STALE_S,
    ) -> None:
        if tau_s <= 0 or stale_s <= 0:
            raise ValueError("tau_s and stale_s must be positive")
        self._clock = clock
        self._tau_s = tau_s
        self._stale_s = stale_s
        self._estimates: dict[str, _Estimate] = {}

    @property
    def stale_s(self) -> float:
        return self._stale_s

    def observe(self, base_url: str, seconds: float, tokens: int) -> None:
        """A request to ``base_url`` produced ``tokens`` completion tokens in ``seconds``
        (ignored without a token or a duration: nothing to learn a speed from)."""
        if tokens <= 0 or seconds <= 0.0:
            return
        now = self._clock()
        est = self._estimates.get(base_url)
        if est is None:
            if len(self._estimates) >= _MAX_ENTRIES:
                self._estimates.clear()
            self._estimates[base_url] = _Estimate(now, seconds, tokens)
            return
        age = max(0.0, now - est.at)
        # a stale estimate was forgotten (the route's mean stood in): start afresh, so one
        # answer of a changed replica is what it is known by, not a blend with the old
        keep = 0.0 if age > self._stale_s else math.exp(-age / self._tau_s)
        est.seconds = est.seconds * keep + seconds
        est.tokens = est.tokens * keep + tokens
        est.spt = est.seconds / est.tokens
        est.at = now

    def seconds_per_token(self, base_url: str, now: float) -> float:
        """The backend's estimate at ``now`` (the clock's time), or 0.0 when it has none
        or it is stale (the caller substitutes the route's mean)."""
        est = self._estimates.get(base_url)
        if est is None or now - est.at > self._stale_s:
            return 0.0
        return est.spt

    def forget(self, base_url: str) -> None:
        self._estimates.pop(base_url, None)
