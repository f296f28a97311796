"""The fair-share step of the request path (M16): a slot of the route's pool, or a wait.

``GatewayApp._proxy`` calls ``enter`` after the router (the pool is known: the route's
targets) and before admission; the slot is held through admission, the send and the whole
relay — a stream holds it until it ends — and given back by ``leave``. The decisions are
``fair_share``'s (pure); this module waits for them: a request queued there waits for its
slot, for its deadline (``max_wait_s``: 503 ``server_overloaded`` with Retry-After) or for
its client to leave (removed from its queue; a slot it had just been given goes on to
the next). A full queue is answered at once: 429 ``rate_limit_exceeded`` naming the
reason, with Retry-After. After a wait the backend is chosen again: the one the router
chose before may no longer be the least busy.

Off (``per_backend`` 0, the default) ``enter`` returns None at once. On, a pool's bound
is the sum of its usable backends' slots: each engine's own where its arguments say
(``Backend.slots``: llama.cpp ``-np``, vLLM ``--max-num-seqs``, a routes file's
``slots``), ``per_backend`` for the others — so a pool of a 4-slot llama.cpp replica and
a 256-sequence vLLM one is bounded at 260, not at twice one setting. With ``--workers N``
each worker gates its own requests over ``ceil(bound / N)`` of each pool's bound: the
workers share one accept queue, so each sees about 1/N of every tenant's traffic and the
sum of their shares is the bound. Fairness is per worker (no cross-process queues).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from heteroflow.gateway.inbound import Call, disconnected
from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.fair_share import (
    WAIT_TIMEOUT,
    FairShare,
    Pool,
    Ticket,
)
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Receive, Send
from heteroflow.schemas.routing import RouteTarget


@dataclass(frozen=True)
class FairShareSettings:
    """The gateway's fair-share settings (``settings.gateway_backend_concurrency`` and
    ``gateway_fair_share_*``); ``per_backend`` 0: off."""

    per_backend: int = 0
    max_queue: int = 64
    max_wait_s: float = 30.0
    retry_after_s: int = 2
    weights: Mapping[str, float] = field(default_factory=dict)
    priority: tuple[str, ...] = ()
    linger_s: float = 30.0


# How often idle pools are forgotten (counted in requests that queued).
_PRUNE_EVERY = 1024
# Routes' pool keys remembered (by their targets tuple) before the memo starts afresh.
_MAX_MEMO = 10_000


class FairGate:
    """Holds the policy and the waiters; one per gateway worker."""

    def __init__(
        self,
        balancer: Balancer,
        metrics: GatewayMetrics,
        *,
        per_backend: int,
        max_queue: int,
        max_wait_s: float,
        retry_after_s: int,
        now: Callable[[], float],
        weights: Mapping[str, float] | None = None,
        priority: frozenset[str] = frozenset(),
        linger_s: float = 0.0,
        workers: int = 1,
    ) -> None:
        self.per_backend = per_backend
        self._share = 1.0 / max(1, workers)
        self._balancer = balancer
        self._metrics = metrics
        self._retry_after = (b"retry-after", str(retry_after_s).encode())
        self._retry_after_s = retry_after_s
        self._now = now
        self.policy = FairShare(
            max_queue=max_queue,
            max_wait_s=max_wait_s,
            now=now,
            weights=weights,
            priority=priority,
            linger_s=linger_s,
        )
        self._queued_count = 0
        self._memo: dict[int, tuple[tuple[RouteTarget, ...], Any, int]] = {}

    def enter(self, call: Call) -> Pool | Ticket | str | None:
        """The hot path: None (off), a ``Pool`` whose slot the request now holds, a
        queued ``Ticket`` or a refusal (``wait`` handles the last two)."""
        if not self.per_backend:
            return None
        targets = call.targets
        # the pool's key and capacity, computed once per snapshot's targets (immutable:
        # a new snapshot brings new tuples)
        memo = self._memo.get(id(targets))
        if memo is None or memo[0] is not targets:
            assert targets is not None
            if len(self._memo) > _MAX_MEMO:
                self._memo.clear()
            memo = self._memo[id(targets)] = (targets, _pool_key(targets), self._capacity(targets))
        pool = self.policy.pool(memo[1], memo[2])
        got = self.policy.enter(pool, call.entry.tenant_id)
        return pool if got is None else got

    async def wait(
        self, got: Ticket | str, call: Call, receive: Receive, send: Send
    ) -> Pool | None:
        """A queued request waits for its slot (the ``Pool``); None when it was answered
        here (429, 503) or its client left."""
        model = call.model
        if isinstance(got, str):  # fair_share.QUEUE_FULL
            self._metrics.fair_refused(model, got)
            await errors.send_error(
                send, _queue_full(model, self._retry_after_s), [self._retry_after]
            )
            return None
        ticket = got
        self._queued_count += 1
        if self._queued_count % _PRUNE_EVERY == 0:
            self.policy.prune()
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[None] = loop.create_future()
        ticket.waiter = granted
        gone = asyncio.ensure_future(disconnected(receive))
        self._metrics.fair_queued(model, +1)
        waited_out = False  # the wait ended by itself (not by an exception)
        try:
            timeout = self.policy.deadline(ticket) - self._now()
            await asyncio.wait(
                (granted, gone), timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED
            )
            waited_out = True
        finally:
            self._metrics.fair_queued(model, -1)
            left = gone.done() and not gone.cancelled()
            gone.cancel()
            if left or not waited_out or not ticket.granted:
                # left, timed out or cancelled: out of its queue, and a slot it was just
                # given goes to the next (never kept by a request that will not use it)
                self._wake(self.policy.cancel(ticket))
        waited = self._now() - ticket.since
        if left:
            self._metrics.fair_refused(model, "client_left")
            return None
        if not ticket.granted:
            self._metrics.fair_refused(model, WAIT_TIMEOUT)
            await errors.send_error(
                send, _wait_timeout(model, waited, self._retry_after_s), [self._retry_after]
            )
            return None
        self._metrics.fair_waited(model, waited)
        targets = call.targets
        assert targets is not None
        backend = self._balancer.choose(targets, call.pin, body=call.body)
        if backend is not None:
            call.backend = backend
        return ticket.pool

    def leave(self, pool: Pool, call: Call) -> None:
        """The request that held a slot of ``pool`` ended (answered, failed or left)."""
        self._wake(self.policy.leave(pool, call.entry.tenant_id))

    def _wake(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            fut: asyncio.Future[None] | None = t.waiter
            if fut is not None and not fut.done():
                fut.set_result(None)
            else:  # its waiter is gone (cannot happen: a waiter cancels first); give it on
                t.granted = False
                self._wake(self.policy.leave(t.pool, t.tenant))

    def _capacity(self, targets: tuple[RouteTarget, ...]) -> int:
        """The pool's bound: each usable backend's slots (its engine's, where the snapshot
        knows them: ``Backend.slots``; else ``per_backend``), summed; this worker's part."""
        per = self.per_backend
        slots = sum(b.slots or per for t in targets for b in t.backends if not b.draining)
        return max(1, math.ceil((slots or per) * self._share))

    def queued(self) -> int:
        """Requests queued now in every pool (tests, metrics)."""
        return sum(p.queued for p in self.policy.pools.values())


def _pool_key(targets: tuple[RouteTarget, ...]) -> Any:
    """A pool is the route's groups: two tenants' routes to one shared service are one
    pool (a routes file's targets have no group: their route id stands in)."""
    if len(targets) == 1:
        t = targets[0]
        return t.group_id or t.route_id
    return tuple(t.group_id or t.route_id for t in targets)


def _queue_full(model: str, retry_after_s: int) -> errors.OpenAIError:
    return errors.OpenAIError(
        429,
        f"The model '{model}' is at capacity and your organization already has the most "
        f"requests waiting for it that fair sharing allows. Please retry in "
        f"{retry_after_s} s.",
        "requests",
        None,
        "rate_limit_exceeded",
    )


def _wait_timeout(model: str, waited_s: float, retry_after_s: int) -> errors.OpenAIError:
    return errors.OpenAIError(
        503,
        f"The model '{model}' is at capacity: your request waited {waited_s:.1f} s for a "
        f"slot in its turn. Please retry in {retry_after_s} s.",
        "server_error",
        None,
        "server_overloaded",
    )
