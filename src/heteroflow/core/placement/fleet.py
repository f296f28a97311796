"""The scheduler's in-memory index of a round's node views: which nodes to try first.

Scanning every node for every task costs O(nodes) per decision (10,000 nodes x 10,000
tasks = 10^8 checks). The index hands ``place`` the nodes most likely to win first, and
``place`` stops after ``Policy.sample`` of them passed:

1. nodes that hold the task's model (locality is the strongest preference): its path,
   or its source in their cache (issue 29);
2. for a shared-card inference task, nodes with a partly booked card of the task's
   tenant / sharing group (stacking there is what binpack wants) — skipping, for now,
   those where no card has both the commitment and the memory left (they would only
   fail: they come later, so a failing node is still counted once);
3. nodes by how many wholly free cards they have — fewest that are still enough first
   (binpack) or most first (spread) — then the rest, so that a task that fits nowhere
   is still checked against every node and its reason counts them all.

Buckets are kept per card model, so a task that names a ``gpu_type`` never walks nodes
of other types, and a model whose largest card cannot hold the task's estimate once the
B3 reservation is kept free is walked last (none of its cards can admit the task).
Nodes that cannot take the task whatever its size — offline, above the load threshold,
or (for inference) at the container cap — are held back to the end, where they are
counted by their set of card models rather than one by one. ``update`` re-files a node
after a booking.

None of this changes a decision, only how soon it is reached: a node is skipped only
where it could not pass, and it is still examined (or counted) once, in the tail, when
nothing passed before it (tests/unit/test_scheduler_scale.py checks placements and
reasons against the index without these shortcuts). One exception by design: a node
with cards of several models is met in the walk of its first model that can really
hold the estimate, which can be later than before the reservation was counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from heteroflow.core.placement import filters as f
from heteroflow.core.placement.model import NodeView, Reservation, TaskDemand

_NO_RESERVATION = Reservation(0, 0.0)


@dataclass(frozen=True, slots=True)
class Tally:
    """Nodes counted per reason key without being evaluated one by one."""

    counts: dict[str, int]


class FleetIndex:
    def __init__(
        self,
        nodes: list[NodeView],
        *,
        pack: bool = True,
        load_threshold_pct: float = 100.0,
        inference_cap: int = 1 << 30,
        reservation: Reservation = _NO_RESERVATION,
    ) -> None:
        self.nodes = nodes
        self.reservation = reservation
        self.pack = pack
        self.cap = inference_cap
        self._offline = {n.id for n in nodes if not n.online}
        # the load threshold gates GPU work only (filters.node_gate): busy nodes are never
        # filed in the card buckets, which only GPU tasks read
        self._gated = self._offline | {
            n.id
            for n in nodes
            if n.cpu_percent > load_threshold_pct or n.memory_percent > load_threshold_pct
        }
        self.by_id = {n.id: n for n in nodes}
        self._models: dict[str, list[NodeView]] = {}
        self._cpu: list[NodeView] = []
        self._gpu_nodes: list[NodeView] = []
        self._by_kind: dict[str, list[NodeView]] = {}  # card model -> nodes, fleet order
        # (card model, at the inference cap) -> free-card count -> nodes (insertion order);
        # nodes offline or over the load threshold are in no bucket
        self._buckets: dict[tuple[str, bool], dict[int, dict[str, NodeView]]] = {}
        self._filed: dict[str, tuple[int, bool]] = {}
        self._kinds: dict[str, tuple[str, ...]] = {}
        # (share key, card model) -> room decile (free commitment // 10) -> nodes that have
        # a partly booked card of that tenant / sharing group with that much room
        self._partial: dict[tuple[str, str], dict[int, dict[str, NodeView]]] = {}
        self._partial_of: dict[str, list[tuple[tuple[str, str], int]]] = {}
        # node id -> (share key or "" for any, commitment left, memory left) of each card
        # that could still take shared inference work: a cheap, conservative pre-check,
        # filled on first use
        self._shared_room: dict[str, tuple[tuple[str, int, int], ...]] = {}
        self._capped: set[str] = set()  # at the inference container cap
        self._card_mb: dict[str, int] = {}  # card model -> largest card of it
        self._vendor: dict[str, str] = {}  # card model -> vendor
        # (estimate, engine vendors) -> card models in the order _likely walks them
        self._kinds_memo: dict[tuple[int, frozenset[str]], list[str]] = {}
        for n in nodes:
            for m in n.models:
                self._models.setdefault(m, []).append(n)
            # issue 29: a source in its cache, by its text, its pinned text and its
            # fleet:// name (a path never holds "://", so the two never meet in this map)
            for text in {
                t for c in n.cached_models if c.complete for t in (c.source, c.pinned, c.fleet)
                if t
            }:
                self._models.setdefault(text, []).append(n)
            kinds = tuple(sorted({c.model for c in n.cards}))
            for c in n.cards:
                self._card_mb[c.model] = max(self._card_mb.get(c.model, 0), c.memory_total_mb)
                self._vendor[c.model] = c.vendor
            self._kinds[n.id] = kinds
            for k in kinds:
                self._by_kind.setdefault(k, []).append(n)
            if not kinds:
                self._cpu.append(n)
            else:
                self._gpu_nodes.append(n)
            self._file(n)

    def holders(self, t: TaskDemand) -> list[NodeView]:
        """The nodes that hold the task's model: its path, or its source in their cache."""
        found = list(self._models.get(t.model_path, ())) if t.model_path else []
        if t.model_source:
            ids = {n.id for n in found}
            found += [n for n in self._models.get(t.model_source, ()) if n.id not in ids]
        return found

    def _file(self, n: NodeView) -> None:
        capped = n.inference_tasks >= self.cap
        if capped:
            self._capped.add(n.id)
        else:
            self._capped.discard(n.id)
        if n.id in self._gated:  # never a candidate this round: only the reason's tally
            return
        free = n.free_cards()
        self._filed[n.id] = (free, capped)
        for k in self._kinds[n.id]:
            self._buckets.setdefault((k, capped), {}).setdefault(free, {})[n.id] = n
        rooms: dict[tuple[str, str], int] = {}
        if not capped:  # partly booked cards only take inference work
            for c in n.cards:
                if c.holders and not c.whole_holders and c.committed_pct < 100 and c.share_key:
                    key = (c.share_key, c.model)
                    rooms[key] = max(rooms.get(key, 0), (100 - c.committed_pct) // 10)
            for key, room in rooms.items():
                self._partial.setdefault(key, {}).setdefault(room, {})[n.id] = n
        self._partial_of[n.id] = list(rooms.items())

    def update(self, n: NodeView) -> None:
        filed = self._filed.pop(n.id, None)
        if filed is not None:
            free, capped = filed
            for k in self._kinds[n.id]:
                self._buckets[(k, capped)][free].pop(n.id, None)
        for key, room in self._partial_of.get(n.id, ()):
            self._partial[key][room].pop(n.id, None)
        self._shared_room.pop(n.id, None)
        self._file(n)

    def _may_share(self, n: NodeView, t: TaskDemand) -> bool:
        """False only when no card of the node can take the shared task (``card_admits``
        would refuse every one: another key's work, not enough commitment or memory
        left); the node's type, vendor and gates are left to ``evaluate``."""
        rooms = self._shared_room.get(n.id)
        if rooms is None:  # worked out when first asked, dropped when the node is booked
            rooms = self._shared_room[n.id] = tuple(
                (c.share_key if c.holders else "", 100 - c.committed_pct,
                 c.available_mb(self.reservation))
                for c in n.cards
                if not c.whole_holders and c.holders == c.inference
            )
        pct, need, key = t.gpu_memory_utilization, t.estimated_gpu_memory_mb, t.share_key
        return any(
            left >= pct and (not need or mb >= need) and (not k or not key or k == key)
            for k, left, mb in rooms
        )

    def _kinds_for(self, t: TaskDemand) -> list[str]:
        """Card models the task's engine drives whose cards can hold its estimate with
        the reservation kept free, smallest first (best fit), then the rest (tried last,
        for the reason: none of their cards can admit the task)."""
        key = (t.estimated_gpu_memory_mb, t.engine_vendors)
        memo = self._kinds_memo.get(key)
        if memo is None:
            res = self.reservation
            fits = sorted(
                (
                    m
                    for m, mb in self._card_mb.items()
                    if mb - res.of(mb) >= t.estimated_gpu_memory_mb
                    and (not t.engine_vendors or self._vendor[m] in t.engine_vendors)
                ),
                key=lambda m: (self._card_mb[m], m),
            )
            memo = self._kinds_memo[key] = fits + sorted(
                m for m in self._card_mb if m not in fits
            )
        return memo

    def order(self, t: TaskDemand) -> Iterator[NodeView | Tally | None]:
        """Every node once: likely winners first; then ``None`` (``place`` stops there
        when it has a candidate); then the nodes that can only add to the reason —
        evaluated one by one where they hold usable cards, else counted in bulk by the
        cause that rules them out whatever the task's size (a ``Tally``)."""
        seen: set[str] = set()
        yield from self._likely(t, seen)
        yield None
        bulk: dict[str, int] = {}
        gated = self._gated if t.gpu_required else self._offline
        capped = self._capped if t.inference else set()
        tenant, kinds_of = t.tenant_id, self._kinds
        ruled: dict[tuple[str, ...], str] = {}  # by the node's card models: 1 of ~10 sets
        for n in self.nodes:
            nid = n.id
            if nid in seen:
                continue
            if n.tenants and tenant and tenant not in n.tenants:  # not n.visible_to(tenant)
                why = f.RESERVED
            elif nid in gated:
                why = f.OFFLINE if not n.online else f.OVERLOADED
            elif nid in capped:
                why = f.CONTAINER_CAP
            else:
                kinds = kinds_of[nid]
                cached = ruled.get(kinds)
                if cached is None:
                    cached = ruled[kinds] = self._ruled_out(kinds, t)
                why = cached
            if why:
                bulk[why] = bulk.get(why, 0) + 1
            else:
                yield n
        yield Tally(bulk)

    def preemption_candidates(self, t: TaskDemand) -> list[NodeView]:
        """The nodes ``plan_preemption`` would look at for the task, in fleet order:
        online, with cards of its ``gpu_type`` (or any cards, for GPU work)."""
        if t.gpu_type:
            pool = self._by_kind.get(t.gpu_type, [])
        elif t.gpu_required:
            pool = self._gpu_nodes
        else:
            pool = self.nodes
        return [n for n in pool if n.id not in self._offline]

    def _ruled_out(self, kinds: tuple[str, ...], t: TaskDemand) -> str:
        if t.gpu_required == 0:
            return ""
        if not kinds:
            return f.NO_GPUS
        if t.gpu_type and t.gpu_type not in kinds:
            return f.TYPE_MISMATCH
        if t.engine_vendors and not any(self._vendor[k] in t.engine_vendors for k in kinds):
            return f.ENGINE_VENDOR
        return ""

    def _likely(self, t: TaskDemand, seen: set[str]) -> Iterator[NodeView]:
        gated = self._gated if t.gpu_required else self._offline
        capped = self._capped if t.inference else set()

        tenant = t.tenant_id

        def fresh(nodes: Iterable[NodeView]) -> Iterator[NodeView]:
            for n in nodes:
                if n.id not in seen and n.id not in gated and n.id not in capped and (
                    not n.tenants or n.visible_to(tenant)
                ):
                    seen.add(n.id)
                    yield n

        def roomy(nodes: Iterable[NodeView]) -> Iterator[NodeView]:
            # not marked seen when skipped: a later bucket or the tail still counts it
            return fresh(n for n in nodes if n.id not in seen and self._may_share(n, t))

        if t.model_path:
            yield from fresh(self._models.get(t.model_path, ()))
        if t.model_source:
            yield from fresh(self._models.get(t.model_source, ()))
        if t.gpu_required == 0:
            yield from fresh(self._cpu)
            return
        kinds = [t.gpu_type] if t.gpu_type else self._kinds_for(t)
        if not t.whole and t.share_key:  # stack on the tenant's partly booked cards
            least = t.gpu_memory_utilization // 10
            for k in kinds:
                rooms = self._partial.get((t.share_key, k), {})
                for room in sorted((r for r in rooms if r >= least), reverse=not self.pack):
                    yield from roomy(rooms[room].values())
        need = t.gpu_required
        # nodes with enough wholly free cards, over every fitting kind, before the rest
        empty: dict[int, dict[str, NodeView]] = {}
        for k in kinds:
            open_ = self._buckets.get((k, False), empty)
            # nodes at the inference cap still take training and containers
            full = self._buckets.get((k, True), empty) if not t.inference else empty
            counts = {c for c in open_ if c >= need} | {c for c in full if c >= need}
            for c in sorted(counts, reverse=not self.pack):
                yield from fresh(open_.get(c, {}).values())
                yield from fresh(full.get(c, {}).values())
