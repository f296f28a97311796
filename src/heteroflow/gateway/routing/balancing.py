"""Backend selection policy over a model's route targets: pure, no I/O.

Policy, applied to the targets of one ``(tenant, model)`` route:

1. Priority (M3): the lowest ``priority`` value among targets that have at least one
   usable backend wins; higher values are failover levels used only when every better
   level is empty.
2. Weight (M3 canary): inside that level, targets with ``weight > 0`` share requests in
   proportion to their weights (smooth weighted round-robin, as nginx does, so a 3:1
   split interleaves A A B A rather than A A A B, and a 90:10 canary gets exactly 10 of
   every 100 requests of this gateway). ``weight == 0`` marks a fallback-only target, used
   only when no positive-weight target of the level has a usable backend; several such
   fallbacks share equally.
3. Backend (M2), by the chosen target's ``algorithm``:

   * ``round_robin`` (default, and for unknown names): in turn;
   * ``random``: uniformly at random;
   * ``least_connections``: the backend with the fewest requests in flight through this
     gateway (``acquire``/``release`` around each upstream request, streams included);
     ties go round-robin so that an idle route still spreads;
   * ``engine_aware``: the lowest ``engine_metrics.engine_score`` from the engines' own
     ``/metrics`` (scraped by ``gateway.probes``: running, waiting, KV cache use, plus
     this gateway's in-flight change since the scrape); served as
     ``least_connections`` while any candidate has no fresh scrape.
   * ``prefix_affinity`` (M15): the backend most likely to hold the request's prompt
     prefix in its engine's cache, bounded by load. The body's prefix keys
     (``prefix.prefix_keys``: chained hashes of 512-byte blocks) are looked up, longest
     first, in a bounded, expiring view of which backend served which key on this route
     (``prefix.PrefixView``); the longest key with a holder that has room wins (the
     holder with fewest in flight). *Room* is consistent hashing with bounded loads: a
     backend may take the request while its in-flight count stays below
     ``max(ceil((1 + ε) · (in flight on the route's usable backends + 1) / n),
     least in flight + slack)``, ε = ``prefix_load_factor`` (0.25), slack =
     ``prefix_slack`` (``gateway_prefix_slack``, 4), so a hot prefix spreads once its
     holder is above the mean instead of piling onto it. The additive slack is for small
     counts, where ``(1 + ε) · mean`` alone spills a prefix as soon as its holder has one
     request more than the others, and a spill costs a whole prefill on a replica
     holding none of it (about 10x a hit in ``bench/prefix_routing.py``) and evicts what
     that replica held; SGLang's cache-aware router has the same kind of absolute
     threshold (64 requests there). At 2 the bench's bursts of three requests spilled,
     and each spill's second-long prefill made the replica it landed on spill the next
     (5 misses in 2 s); 4 keeps them (docs/benchmarks.md). A request no view entry
     matches goes by rendezvous hashing of its first block's key over the base URLs: the
     first in rank with room for the request and for the prefix's blocks (the blocks the
     view says each backend holds, ``PrefixView.held``, bounded as loads are by
     ``max(ceil((1 + ε) · (held by all + k) / n), least held + k)``), so several gateways place a
     new prefix alike without sharing state while their views agree, and new prefixes
     fill the caches evenly; a body with no full block (or none at all: a failover) goes
     by ``least_connections``. Every key of the request is then recorded for the chosen
     backend.
   * ``capacity`` (M15): the lowest expected completion cost, ``(in flight + 1) x the
     backend's seconds per completion token`` (``capacity.CapacityView``, learned from
     this gateway's answers: ``observe``), so a replica three times slower holds fewer
     requests than a fast one (least_connections holds them equal and makes its answers
     three times slower) and, while both are busy, gets a quarter of the traffic. A
     backend with no fresh estimate (new, or unanswered for ``stale_s``) counts at the
     mean of the route's others, so it is tried; with no estimate at all it is
     ``least_connections``.

Usable backends. A *draining* backend (M11) is never chosen: in-flight requests finish,
new ones go elsewhere, and a route whose backends all drain answers 503. The other
conditions are preferences, relaxed in this order when nothing in the whole route meets
them, so that a route is never left empty by a guess:

* a backend on a card hotter than ``max_temp_c`` (M4 temperature filter) is avoided
  while any cooler usable backend exists (even in a failover level or a weight-0
  fallback: cooling a card beats the canary split);
* a backend ejected in ``PassiveHealth`` (M5: a failed request, or a failed active
  probe) is skipped; when *every* non-draining backend is ejected, selection fails open
  and tries one anyway: a cooldown is a guess made from one failure, and a dead backend
  costs the same 502 it would have cost. (Not so for the failover of a request whose
  connection failed, ``choose(..., fail_open=False)``: it has an answer already.)

Stickiness (M4): with a ``session`` key, the backend chosen for it is remembered
(a bounded LRU map of base URLs) and returned again while it is still a usable backend
(same filter: not draining, ejected or hot) of a target that normal selection would
choose among (same priority level and weight class, so stickiness never overrides
failover or fallback-only rules); otherwise the session is re-pinned.

The ``Balancer`` keeps only counters and maps; it is not thread-safe and is meant to be
used from one event loop.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from hashlib import blake2b
from typing import Any, NamedTuple

from heteroflow.gateway.backend.engine_metrics import EngineLoad, engine_score
from heteroflow.gateway.routing.capacity import DEFAULT_STALE_S, DEFAULT_TAU_S, CapacityView
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.gateway.routing.inflight import InFlight, LocalInFlight
from heteroflow.gateway.routing.prefix import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL_S,
    PrefixView,
    prefix_keys,
)
from heteroflow.schemas.routing import Backend, RouteTarget

# Counters of routes that no longer exist are dropped wholesale past this size; resetting
# a rotation position is harmless, unbounded growth over months of route churn is not.
_MAX_COUNTERS = 10_000
DEFAULT_MAX_SESSIONS = 10_000
DEFAULT_MAX_TEMP_C = 85.0

ROUND_ROBIN = "round_robin"
RANDOM = "random"
LEAST_CONNECTIONS = "least_connections"
ENGINE_AWARE = "engine_aware"
PREFIX_AFFINITY = "prefix_affinity"
CAPACITY = "capacity"
DEFAULT_PREFIX_LOAD_FACTOR = 0.25
DEFAULT_PREFIX_SLACK = 4
_MASK64 = (1 << 64) - 1
_LEAST = frozenset({LEAST_CONNECTIONS, ENGINE_AWARE, CAPACITY})


class _Filter(NamedTuple):
    """Which backends count as usable (draining ones never do)."""

    health: PassiveHealth | None  # None: ignore ejection
    max_temp_c: float | None  # None: ignore temperature

    def ok(self, b: Backend) -> bool:
        if b.draining:
            return False
        limit = self.max_temp_c
        if limit is not None and b.temperature_c is not None and b.temperature_c > limit:
            return False
        health = self.health
        return health is None or not health.is_ejected(b.base_url)


class Balancer:
    """Chooses one backend for a request; holds the selection state between calls."""

    __slots__ = (
        "_capacity",
        "_clock",
        "_health",
        "_inflight",
        "_loads",
        "_max_sessions",
        "_max_temp_c",
        "_prefix",
        "_prefix_load_factor",
        "_prefix_slack",
        "_rng",
        "_rr",
        "_smooth",
        "_sticky",
    )

    def __init__(
        self,
        health: PassiveHealth | None = None,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        rng: random.Random | None = None,
        max_temp_c: float | None = DEFAULT_MAX_TEMP_C,
        loads: Mapping[str, EngineLoad] | None = None,
        clock: Callable[[], float] = time.monotonic,
        inflight: InFlight | None = None,
        prefix_entries: int = DEFAULT_MAX_ENTRIES,
        prefix_ttl_s: float = DEFAULT_TTL_S,
        prefix_load_factor: float = DEFAULT_PREFIX_LOAD_FACTOR,
        prefix_slack: int = DEFAULT_PREFIX_SLACK,
        capacity_tau_s: float = DEFAULT_TAU_S,
        capacity_stale_s: float = DEFAULT_STALE_S,
    ) -> None:
        self._health = health if health is not None else PassiveHealth()
        self._smooth: dict[str, int] = {}  # route_id -> current smooth-WRR weight
        self._rr: dict[str, int] = {}  # route_id -> next backend index
        # base_url -> requests in flight; shared by a host's workers (``inflight``)
        self._inflight: InFlight = LocalInFlight() if inflight is None else inflight
        self._sticky: OrderedDict[Hashable, str] = OrderedDict()  # session -> base_url
        self._max_sessions = max_sessions
        self._rng = rng if rng is not None else random.Random()
        self._max_temp_c = max_temp_c
        # base_url -> the latest engine scrape (kept current by gateway.probes)
        self._loads: Mapping[str, EngineLoad] = loads if loads is not None else {}
        # prefix_affinity: which backend served which prompt prefix (bounded, expiring)
        self._prefix = PrefixView(clock, max_entries=prefix_entries, ttl_s=prefix_ttl_s)
        self._prefix_load_factor = prefix_load_factor
        self._prefix_slack = max(1, prefix_slack)
        # capacity: each backend's seconds per completion token (fed by ``observe``)
        self._clock = clock
        self._capacity = CapacityView(clock, tau_s=capacity_tau_s, stale_s=capacity_stale_s)

    @property
    def health(self) -> PassiveHealth:
        return self._health

    @property
    def prefix_view(self) -> PrefixView:
        return self._prefix

    # -- in-flight accounting (least_connections) ---------------------------------------

    def acquire(self, backend: Backend) -> None:
        """A request to ``backend`` is starting; pair with exactly one ``release``."""
        self._inflight.add(backend.base_url, 1)

    def release(self, backend: Backend) -> None:
        self._inflight.add(backend.base_url, -1)

    def in_flight(self, backend: Backend) -> int:
        return self._inflight.get(backend.base_url, 0)

    def in_flight_at(self, base_url: str) -> int:
        return self._inflight.get(base_url, 0)

    def observe(self, backend: Backend, seconds: float, completion_tokens: int) -> None:
        """``backend`` answered ``completion_tokens`` in ``seconds`` (the ``capacity``
        estimate; from ``forward``, for every answered request whose usage is known)."""
        self._capacity.observe(backend.base_url, seconds, completion_tokens)

    @property
    def capacity_view(self) -> CapacityView:
        return self._capacity

    # -- selection ----------------------------------------------------------------------

    def choose(
        self,
        targets: Sequence[RouteTarget],
        session: Hashable | None = None,
        *,
        fail_open: bool = True,
        body: Mapping[str, Any] | None = None,
    ) -> Backend | None:
        """The backend for the next request, or None when no target has a usable one.

        ``fail_open=False`` never relaxes ejection (a failover after a failed connection
        wants a healthy backend or none; see ``gateway.retry``). ``body``: the request's
        JSON body, read (for its prompt prefix) only by a ``prefix_affinity`` target.
        """
        health = self._health if self._health.any_ejected() else None
        flt = _Filter(health, self._max_temp_c)
        level = _eligible(targets, flt)
        if level is None and flt.max_temp_c is not None:
            flt = _Filter(health, None)  # every cool backend is out: accept a hot one
            level = _eligible(targets, flt)
        if level is None and health is not None and fail_open:
            flt = _Filter(None, None)  # fail open: every backend is ejected, try one anyway
            level = _eligible(targets, flt)
        if level is None:
            return None
        if session is not None:
            pinned = self._sticky.get(session)
            if pinned is not None:
                current = _find(pinned, level, flt)
                if current is not None:
                    self._sticky.move_to_end(session)
                    return current
        target = level[0] if len(level) == 1 else self._pick_weighted(level, level[0].weight > 0)
        backend = self._next_backend(target, flt, body)
        if session is not None:
            sticky = self._sticky
            sticky[session] = backend.base_url
            sticky.move_to_end(session)
            if len(sticky) > self._max_sessions:
                sticky.popitem(last=False)
        return backend

    def _pick_weighted(self, candidates: list[RouteTarget], use_weight: bool) -> RouteTarget:
        smooth = self._smooth
        if len(smooth) > _MAX_COUNTERS:
            smooth.clear()
        total = 0
        chosen = candidates[0]
        chosen_cur: int | None = None
        for t in candidates:
            w = t.weight if use_weight else 1
            cur = smooth.get(t.route_id, 0) + w
            smooth[t.route_id] = cur
            total += w
            if chosen_cur is None or cur > chosen_cur:
                chosen, chosen_cur = t, cur
        smooth[chosen.route_id] -= total
        return chosen

    def _next_backend(
        self, target: RouteTarget, flt: _Filter, body: Mapping[str, Any] | None = None
    ) -> Backend:
        backends = target.backends
        if not all(map(flt.ok, backends)):
            backends = tuple(filter(flt.ok, backends))
        n = len(backends)
        algorithm = target.algorithm
        if algorithm == PREFIX_AFFINITY and body is not None:
            keys = prefix_keys(body)
            if keys:
                chosen = backends[0] if n == 1 else self._affinity(target.route_id, backends, keys)
                self._prefix.record(target.route_id, keys, chosen.base_url)
                return chosen
        if n == 1:
            return backends[0]
        if algorithm == RANDOM:
            return backends[self._rng.randrange(n)]
        rr = self._rr
        if len(rr) > _MAX_COUNTERS:
            rr.clear()
        i = rr.get(target.route_id, 0) % n
        rr[target.route_id] = (i + 1) % n
        if algorithm not in _LEAST and algorithm != PREFIX_AFFINITY:
            return backends[i]
        if algorithm == ENGINE_AWARE and self._loads:
            best = self._least_loaded(backends, i)
            if best is not None:
                return best
        elif algorithm == CAPACITY:
            best = self._least_cost(backends, i)
            if best is not None:
                return best
        # Fewest in flight; scanning from the round-robin position breaks ties in turn.
        inflight = self._inflight
        best = backends[i]
        best_n = inflight.get(best.base_url, 0)
        for k in range(1, n):
            if best_n == 0:
                break
            b = backends[(i + k) % n]
            c = inflight.get(b.base_url, 0)
            if c < best_n:
                best, best_n = b, c
        return best

    def _affinity(self, route_id: str, backends: Sequence[Backend], keys: Sequence[int]) -> Backend:
        """prefix_affinity's choice among ≥ 2 usable backends (see the module doc)."""
        inflight = self._inflight
        loads = [inflight.get(b.base_url, 0) for b in backends]
        # Bounded loads: the load a backend may reach by taking this request. The least
        # loaded backend always has room (slack ≥ 1), so some backend is chosen below.
        bound = max(
            math.ceil((1.0 + self._prefix_load_factor) * (sum(loads) + 1) / len(backends)),
            min(loads) + self._prefix_slack,
        )
        index = {b.base_url: i for i, b in enumerate(backends)}
        holders = self._prefix.holders
        for key in reversed(keys):  # the longest prefix first
            best = -1
            for url in holders(route_id, key):
                i = index.get(url, -1)
                if i >= 0 and loads[i] < bound and (best < 0 or loads[i] < loads[best]):
                    best = i
            if best >= 0:
                return backends[best]
        # No backend with room holds any of it: a new prefix (or a spill). Rendezvous
        # hashing of the first block ranks the backends alike in every gateway; the first
        # in rank with room for the request and for the prefix takes it. Room for the
        # prefix: the blocks the view believes a backend holds stay within
        # ``max(ceil((1 + ε) · (blocks held by all + these) / n), least held + these)``,
        # so that hashing cannot give one replica more prefixes than its cache keeps
        # while another's is empty (8 groups over 2 replicas by hashing alone: 6 and 2).
        # The (1 + ε) keeps rendezvous rank deciding while the split is near even, so
        # gateways (and a gateway's workers, each with its own view) whose histories
        # differ still mostly agree; an exact even split (ε = 0) placed the bench's
        # groups 4:4 instead of 5:3 but left as many misses (13 against 17 in 144-154).
        first = keys[0]
        ranked = sorted(
            range(len(backends)), key=lambda i: _mix64(first ^ _url_hash(backends[i].base_url))
        )
        view_held = self._prefix.held
        held = [view_held(b.base_url) for b in backends]
        k = len(keys)
        cap = max(
            math.ceil((1.0 + self._prefix_load_factor) * (sum(held) + k) / len(backends)),
            min(held) + k,
        )
        for i in ranked:
            if loads[i] < bound and held[i] + k <= cap:
                return backends[i]
        for i in ranked:
            if loads[i] < bound:
                return backends[i]
        return backends[ranked[0]]  # unreachable (see above); keeps the type total

    def _least_cost(self, backends: Sequence[Backend], start: int) -> Backend | None:
        """capacity's choice: lowest ``(in flight + 1) x seconds per token``, ties in turn
        from ``start``; None when no backend has an estimate (least_connections decides).
        Two passes over the backends and no container allocated: the mean first (for
        those without an estimate), then the costs."""
        now = self._clock()
        spt = self._capacity.seconds_per_token
        total = 0.0
        known = 0
        for b in backends:
            s = spt(b.base_url, now)
            if s > 0.0:
                total += s
                known += 1
        if not known:
            return None
        mean = total / known
        inflight = self._inflight
        n = len(backends)
        best = backends[start]
        best_cost = (inflight.get(best.base_url, 0) + 1) * (spt(best.base_url, now) or mean)
        for k in range(1, n):
            b = backends[(start + k) % n]
            cost = (inflight.get(b.base_url, 0) + 1) * (spt(b.base_url, now) or mean)
            if cost < best_cost:
                best, best_cost = b, cost
        return best

    def _least_loaded(self, backends: Sequence[Backend], start: int) -> Backend | None:
        """Lowest engine score, ties in turn from ``start``; None if a scrape is missing."""
        loads = self._loads
        inflight = self._inflight
        n = len(backends)
        best: Backend | None = None
        best_score = 0.0
        for k in range(n):
            b = backends[(start + k) % n]
            load = loads.get(b.base_url)
            if load is None:
                return None  # scores and counts do not mix: least_connections decides
            score = engine_score(load, inflight.get(b.base_url, 0))
            if best is None or score < best_score:
                best, best_score = b, score
        return best


_URL_HASHES: dict[str, int] = {}


def _url_hash(base_url: str) -> int:
    """A stable 64-bit hash of a base URL (the same in every gateway process)."""
    h = _URL_HASHES.get(base_url)
    if h is None:
        if len(_URL_HASHES) > _MAX_COUNTERS:
            _URL_HASHES.clear()
        h = int.from_bytes(blake2b(base_url.encode(), digest_size=8).digest(), "little")
        _URL_HASHES[base_url] = h
    return h


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread, stable rank from a key and a URL hash."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _eligible(targets: Sequence[RouteTarget], flt: _Filter) -> list[RouteTarget] | None:
    """The targets normal selection chooses among: best usable level, weight class."""
    ok = flt.ok
    best: int | None = None
    usable: list[RouteTarget] = []
    for t in targets:
        if (best is None or t.priority <= best) and any(map(ok, t.backends)):
            if best is None or t.priority < best:
                best = t.priority
                usable = [t]
            else:
                usable.append(t)
    if best is None:
        return None
    if len(usable) > 1:
        weighted = [t for t in usable if t.weight > 0]
        if weighted:
            return weighted
    return usable


def _find(base_url: str, level: list[RouteTarget], flt: _Filter) -> Backend | None:
    """The current, usable backend at ``base_url`` among ``level``'s targets."""
    for t in level:
        for b in t.backends:
            if b.base_url == base_url:
                return b if flt.ok(b) else None
    return None
