"""Fair share under overload (M16): which waiting request a freed slot goes to. Pure.

A *pool* is the replicas a route sends to — the route targets' groups, so the routes of
two tenants that share one service are one pool. It has a *capacity*: requests in flight
through this gateway at which it counts as saturated (the sum of its usable backends'
slots: each engine's own where its arguments set them, ``Backend.slots``, else the
gateway's ``gateway_backend_concurrency``; ``fair_gate``). Why that signal and not the
engine's queue from the scrapes: it is exact and immediate (a scrape is 0.25-5 s old,
and a queue that has drained between two scrapes would keep requests waiting), every
backend has it (an external one may have no ``/metrics``), and a request that ends is
the event that frees a slot — the moment to let the next one in. The engine's own
slots are the bound (llama.cpp ``--parallel``, vLLM ``--max-num-seqs``, read from its
arguments): at that bound the engine's queue is empty and every queued request waits
here, in order.

Below the capacity a request passes (``enter`` returns ``PASSED``: a dict lookup and two
integer compares). At it, the request waits in its tenant's FIFO queue and slots are
handed out by start-time fair queueing (SFQ, Goyal et al. 1996): a request gets the
virtual start tag ``max(v, F_tenant)`` and its tenant's finish tag moves to that plus
``1 / weight``; a freed slot goes to the queued head with the smallest start tag (ties:
arrival order), and ``v`` becomes that tag. So a tenant that sends ten times its share
only lengthens its own queue: a request of a quieter tenant is tagged ``v`` and goes
next (after at most one request of each backlogged tenant). Tenants in ``priority``
(the platform's own) are served before every other tenant's queue.

Bounds, all decided here and answered by the caller (``fair_gate``): a tenant's queue
holds at most ``max_queue`` requests of a pool (one more is ``QUEUE_FULL``: 429, the
tenant is over its share — only its own queue is full); a request waits at most
``max_wait_s`` (``deadline``: 503, the pool had no room in time though the tenant was
within its share — a server condition); a request whose client left is removed
(``cancel``), and one that had just been handed a slot gives it on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

PASSED = None  # ``enter``: the pool had room; the caller holds a slot
QUEUE_FULL = "queue_full"  # the tenant's queue of this pool is full (429)
WAIT_TIMEOUT = "wait_timeout"  # queued longer than max_wait_s (503)


@dataclass(eq=False)
class Ticket:
    """One queued request. ``granted`` turns True when a slot is handed to it (the caller
    then holds that slot and must ``leave``)."""

    pool: Pool
    tenant: str
    start: float  # virtual start tag
    seq: int  # arrival order (ties)
    since: float  # when it was queued (now())
    granted: bool = False
    done: bool = False  # granted, cancelled or expired: no longer queued
    waiter: Any = None  # the caller's (what it wakes when the ticket is granted)


@dataclass(eq=False)
class Pool:
    """One pool's slots and queues."""

    capacity: int
    in_flight: int = 0
    queued: int = 0
    vtime: float = 0.0
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> last finish tag
    running: dict[str, int] = field(default_factory=dict)  # tenant -> slots it holds
    seen: dict[str, float] = field(default_factory=dict)  # tenant -> its last arrival


class FairShare:
    """Pools by key; one per gateway worker (the gateway is one event loop: no locks)."""

    def __init__(
        self,
        *,
        max_queue: int,
        max_wait_s: float,
        now: Callable[[], float],
        weights: Mapping[str, float] | None = None,
        priority: frozenset[str] = frozenset(),
        linger_s: float = 0.0,
    ) -> None:
        if max_queue < 0 or max_wait_s < 0 or linger_s < 0:
            raise ValueError("max_queue, max_wait_s and linger_s must be >= 0")
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.linger_s = linger_s
        self._now = now
        self._weights = dict(weights or {})
        self._priority = priority
        self._seq = 0
        self.pools: dict[object, Pool] = {}

    def pool(self, key: object, capacity: int) -> Pool:
        """The pool under ``key``; its capacity follows the route (replicas come and go)."""
        p = self.pools.get(key)
        if p is None:
            p = self.pools[key] = Pool(capacity)
        elif p.capacity != capacity:
            p.capacity = capacity
        return p

    def enter(self, pool: Pool, tenant: str) -> Ticket | str | None:
        """``PASSED`` (room: the caller holds a slot), a queued ``Ticket``, or
        ``QUEUE_FULL``."""
        now = self._now()
        pool.seen[tenant] = now
        if (
            pool.in_flight < pool.capacity
            and tenant not in pool.queues
            and (len(pool.seen) == 1 or pool.running.get(tenant, 0) < self._caps(pool, now)(tenant))
        ):
            pool.in_flight += 1
            pool.running[tenant] = pool.running.get(tenant, 0) + 1
            return PASSED
        q = pool.queues.get(tenant)
        if q is None:
            q = pool.queues[tenant] = deque()
        if len(q) >= self.max_queue:
            return QUEUE_FULL
        start = max(pool.vtime, pool.finish.get(tenant, 0.0))
        pool.finish[tenant] = start + 1.0 / self._weights.get(tenant, 1.0)
        self._seq += 1
        t = Ticket(pool, tenant, start, self._seq, now)
        q.append(t)
        pool.queued += 1
        return t

    def leave(self, pool: Pool, tenant: str) -> list[Ticket]:
        """A slot held by a request of ``tenant`` in ``pool`` is free (the request ended);
        returns the tickets granted a slot by it (the caller wakes them)."""
        pool.in_flight -= 1
        n = pool.running[tenant] - 1
        if n:
            pool.running[tenant] = n
        else:
            del pool.running[tenant]
        return self._grant(pool)

    def cancel(self, ticket: Ticket) -> list[Ticket]:
        """The client left (or gave up) while ``ticket`` waited: out of its queue; a slot
        already granted to it goes to the next. Returns the tickets granted."""
        if ticket.granted:
            ticket.granted = False
            return self.leave(ticket.pool, ticket.tenant)
        if not ticket.done:
            self._remove(ticket)
        return []

    def deadline(self, ticket: Ticket) -> float:
        """When a queued ``ticket`` stops waiting (``now()``'s scale): its caller then
        ``cancel``s it and answers ``WAIT_TIMEOUT``."""
        return ticket.since + self.max_wait_s

    def prune(self) -> None:
        """Forget idle pools (nothing in flight or queued): routes come and go."""
        for key in [k for k, p in self.pools.items() if not p.in_flight and not p.queued]:
            del self.pools[key]

    def _remove(self, t: Ticket) -> None:
        pool = t.pool
        q = pool.queues[t.tenant]
        if q and q[-1] is t:
            # the tenant's newest request: its finish tag goes back to where it was, so a
            # client that gave up is not counted against its tenant
            pool.finish[t.tenant] = t.start
        q.remove(t)
        t.done = True
        pool.queued -= 1
        if not q:
            del pool.queues[t.tenant]

    def _caps(self, pool: Pool, now: float) -> Callable[[str], float]:
        """Each tenant's cap on slots now: ``capacity`` (work-conserving) unless
        ``linger_s``; then, for a tenant outside ``priority``, its weighted share of
        ``capacity`` among the tenants active in the pool (a slot held or a request
        queued, or one arrived within ``linger_s``), rounded up. Tenants that left the
        window are forgotten here."""
        capacity = pool.capacity
        if not self.linger_s:
            return lambda _tenant: capacity
        cutoff = now - self.linger_s
        seen, w, prio = pool.seen, self._weights, self._priority
        gone = [
            t
            for t, at in seen.items()
            if at < cutoff and t not in pool.running and t not in pool.queues
        ]
        for t in gone:
            del seen[t]
        total = sum(w.get(t, 1.0) for t in seen if t not in prio)

        def cap(tenant: str) -> float:
            if tenant in prio or not total:
                return capacity
            return math.ceil(capacity * w.get(tenant, 1.0) / total - 1e-9)

        return cap

    def _grant(self, pool: Pool) -> list[Ticket]:
        out: list[Ticket] = []
        caps: Callable[[str], float] | None = None
        while pool.queued and pool.in_flight < pool.capacity:
            if caps is None:
                caps = self._caps(pool, self._now())
            best: Ticket | None = None
            best_rank: tuple[bool, float, int] | None = None
            for tenant, q in pool.queues.items():
                if pool.running.get(tenant, 0) >= caps(tenant):
                    continue  # at its share while others are active: the rest is theirs
                head = q[0]
                rank = (tenant not in self._priority, head.start, head.seq)
                if best_rank is None or rank < best_rank:
                    best, best_rank = head, rank
            if best is None:  # every queued tenant is at its share: slots stay reserved
                break
            q = pool.queues[best.tenant]
            q.popleft()
            if not q:
                del pool.queues[best.tenant]
            pool.queued -= 1
            pool.vtime = max(pool.vtime, best.start)
            pool.in_flight += 1
            pool.running[best.tenant] = pool.running.get(best.tenant, 0) + 1
            best.granted = best.done = True
            out.append(best)
        return out
