"""Backend selection policy over a model's route targets: pure, no I/O.

Policy, applied to the targets of one ``(tenant, model)`` route:

1. Priority: the lowest ``priority`` value among targets that have at least one backend
   wins; higher values are failover levels used only when every better level is empty.
2. Weight: inside that level, targets with ``weight > 0`` share requests in proportion to
   their weights (smooth weighted round-robin, as nginx does, so a 3:1 split interleaves
   A A B A rather than A A A B). ``weight == 0`` marks a fallback-only target, used only
   when no positive-weight target of the level has a backend; several such fallbacks
   share equally.
3. Backend: round-robin among the chosen target's backends.

The ``Balancer`` keeps only counters (keyed by ``route_id``); it is not thread-safe and is
meant to be used from one event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from heteroflow.gateway.snapshot import Backend, RouteTarget

# Counters of routes that no longer exist are dropped wholesale past this size; resetting
# a rotation position is harmless, unbounded growth over months of route churn is not.
_MAX_COUNTERS = 10_000


class Balancer:
    """Chooses one backend for a request; holds the round-robin state between calls."""

    __slots__ = ("_rr", "_smooth")

    def __init__(self) -> None:
        self._smooth: dict[str, int] = {}  # route_id -> current smooth-WRR weight
        self._rr: dict[str, int] = {}  # route_id -> next backend index

    def choose(self, targets: Sequence[RouteTarget]) -> Backend | None:
        """The backend for the next request, or None when no target has a backend."""
        best: int | None = None
        for t in targets:
            if t.backends and (best is None or t.priority < best):
                best = t.priority
        if best is None:
            return None
        level = [t for t in targets if t.priority == best and t.backends]
        if len(level) == 1:
            target = level[0]
        else:
            weighted = [t for t in level if t.weight > 0]
            target = (
                self._pick_weighted(weighted, True)
                if weighted
                else self._pick_weighted(level, False)
            )
        return self._next_backend(target)

    def _pick_weighted(self, candidates: list[RouteTarget], use_weight: bool) -> RouteTarget:
        if len(candidates) == 1:
            return candidates[0]
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

    def _next_backend(self, target: RouteTarget) -> Backend:
        backends = target.backends
        if len(backends) == 1:
            return backends[0]
        rr = self._rr
        if len(rr) > _MAX_COUNTERS:
            rr.clear()
        i = rr.get(target.route_id, 0)
        rr[target.route_id] = (i + 1) % len(backends)
        return backends[i % len(backends)]
