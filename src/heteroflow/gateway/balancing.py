"""Backend selection policy over a model's route targets: pure, no I/O.

Policy, applied to the targets of one ``(tenant, model)`` route:

1. Priority: the lowest ``priority`` value among targets that have at least one usable
   backend wins; higher values are failover levels used only when every better level is
   empty.
2. Weight: inside that level, targets with ``weight > 0`` share requests in proportion to
   their weights (smooth weighted round-robin, as nginx does, so a 3:1 split interleaves
   A A B A rather than A A A B). ``weight == 0`` marks a fallback-only target, used only
   when no positive-weight target of the level has a usable backend; several such
   fallbacks share equally.
3. Backend (M2), by the chosen target's ``algorithm``:

   * ``round_robin`` (default, and for unknown names): in turn;
   * ``random``: uniformly at random;
   * ``least_connections``: the backend with the fewest requests in flight through this
     gateway (``acquire``/``release`` around each upstream request, streams included);
     ties go round-robin so that an idle route still spreads;
   * ``engine_aware`` is not implemented yet: it is served as ``least_connections``, the
     closest signal this gateway has on its own (local in-flight counts).

Passive health (M5): a backend ejected in ``PassiveHealth`` is not usable, so a level
whose backends are all ejected is skipped like an empty one. When *every* backend of
every level is ejected, selection fails open: it ignores ejection and picks as if all
were healthy. A cooldown is a guess made from one failure; trying a backend that may
have recovered beats answering 503 for the rest of the cooldown, and a dead one costs
the same 502 it would have cost anyway.

Stickiness (M4): with a ``session`` key, the backend chosen for it is remembered
(a bounded LRU map) and returned again while it is still a usable backend of a target
that normal selection would choose among (same priority level and weight class, so
stickiness never overrides failover or fallback-only rules); otherwise the session is
re-pinned to a freshly selected backend.

The ``Balancer`` keeps only counters and maps; it is not thread-safe and is meant to be
used from one event loop.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from heteroflow.gateway.health import PassiveHealth
from heteroflow.gateway.snapshot import Backend, RouteTarget

# Counters of routes that no longer exist are dropped wholesale past this size; resetting
# a rotation position is harmless, unbounded growth over months of route churn is not.
_MAX_COUNTERS = 10_000
DEFAULT_MAX_SESSIONS = 10_000

ROUND_ROBIN = "round_robin"
RANDOM = "random"
LEAST_CONNECTIONS = "least_connections"
ENGINE_AWARE = "engine_aware"
_LEAST = frozenset({LEAST_CONNECTIONS, ENGINE_AWARE})


class Balancer:
    """Chooses one backend for a request; holds the selection state between calls."""

    __slots__ = ("_health", "_inflight", "_max_sessions", "_rng", "_rr", "_smooth", "_sticky")

    def __init__(
        self,
        health: PassiveHealth | None = None,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        rng: random.Random | None = None,
    ) -> None:
        self._health = health if health is not None else PassiveHealth()
        self._smooth: dict[str, int] = {}  # route_id -> current smooth-WRR weight
        self._rr: dict[str, int] = {}  # route_id -> next backend index
        self._inflight: dict[str, int] = {}  # base_url -> requests in flight (> 0 only)
        self._sticky: OrderedDict[Hashable, Backend] = OrderedDict()  # session -> backend
        self._max_sessions = max_sessions
        self._rng = rng if rng is not None else random.Random()

    @property
    def health(self) -> PassiveHealth:
        return self._health

    # -- in-flight accounting (least_connections) ---------------------------------------

    def acquire(self, backend: Backend) -> None:
        """A request to ``backend`` is starting; pair with exactly one ``release``."""
        inflight = self._inflight
        url = backend.base_url
        inflight[url] = inflight.get(url, 0) + 1

    def release(self, backend: Backend) -> None:
        inflight = self._inflight
        url = backend.base_url
        n = inflight.get(url, 0) - 1
        if n > 0:
            inflight[url] = n
        else:
            inflight.pop(url, None)

    def in_flight(self, backend: Backend) -> int:
        return self._inflight.get(backend.base_url, 0)

    # -- selection ----------------------------------------------------------------------

    def choose(
        self, targets: Sequence[RouteTarget], session: Hashable | None = None
    ) -> Backend | None:
        """The backend for the next request, or None when no target has a backend."""
        health: PassiveHealth | None = self._health
        if health is not None and health.any_ejected():
            level = _eligible(targets, health)
            if level is None:
                health = None  # fail open: every backend is ejected, try one anyway
                level = _eligible(targets, None)
        else:
            health = None
            level = _eligible(targets, None)
        if level is None:
            return None
        if session is not None:
            pinned = self._sticky.get(session)
            if pinned is not None and _usable_in(pinned, level, health):
                self._sticky.move_to_end(session)
                return pinned
        target = level[0] if len(level) == 1 else self._pick_weighted(level, level[0].weight > 0)
        backend = self._next_backend(target, health)
        if session is not None:
            sticky = self._sticky
            sticky[session] = backend
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

    def _next_backend(self, target: RouteTarget, health: PassiveHealth | None) -> Backend:
        backends = target.backends
        if health is not None:
            backends = tuple(b for b in backends if not health.is_ejected(b.base_url))
        n = len(backends)
        if n == 1:
            return backends[0]
        algorithm = target.algorithm
        if algorithm == RANDOM:
            return backends[self._rng.randrange(n)]
        rr = self._rr
        if len(rr) > _MAX_COUNTERS:
            rr.clear()
        i = rr.get(target.route_id, 0) % n
        rr[target.route_id] = (i + 1) % n
        if algorithm not in _LEAST:
            return backends[i]
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


def _usable(t: RouteTarget, health: PassiveHealth | None) -> bool:
    if health is None:
        return bool(t.backends)
    return any(not health.is_ejected(b.base_url) for b in t.backends)


def _eligible(
    targets: Sequence[RouteTarget], health: PassiveHealth | None
) -> list[RouteTarget] | None:
    """The targets normal selection chooses among: best usable level, weight class."""
    best: int | None = None
    for t in targets:
        if (best is None or t.priority < best) and _usable(t, health):
            best = t.priority
    if best is None:
        return None
    level = [t for t in targets if t.priority == best and _usable(t, health)]
    if len(level) > 1:
        weighted = [t for t in level if t.weight > 0]
        if weighted:
            return weighted
    return level


def _usable_in(backend: Backend, level: list[RouteTarget], health: PassiveHealth | None) -> bool:
    if health is not None and health.is_ejected(backend.base_url):
        return False
    return any(backend in t.backends for t in level)
