"""The scheduler's in-memory index of a round's node views: which nodes to try first.

Scanning every node for every task costs O(nodes) per decision (10,000 nodes x 10,000
tasks = 10^8 checks). The index hands ``place`` the nodes most likely to win first, and
``place`` stops after ``Policy.sample`` of them passed:

1. nodes that hold the task's model (locality is the strongest preference);
2. for a shared-card inference task, nodes with a partly booked card of the task's
   tenant / sharing group (stacking there is what binpack wants);
3. nodes by how many wholly free cards they have — fewest that are still enough first
   (binpack) or most first (spread) — then the rest, so that a task that fits nowhere
   is still checked against every node and its reason counts them all.

Buckets are kept per card model, so a task that names a ``gpu_type`` never walks nodes
of other types. Nodes that cannot take the task whatever its size — offline, above the
load threshold, or (for inference) at the container cap — are held back to the end.
``update`` re-files a node after a booking.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from heteroflow.core.placement import filters as f
from heteroflow.core.placement.model import NodeView, TaskDemand


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
    ) -> None:
        self.nodes = nodes
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
        # (card model, at the inference cap) -> free-card count -> nodes (insertion order);
        # nodes offline or over the load threshold are in no bucket
        self._buckets: dict[tuple[str, bool], dict[int, dict[str, NodeView]]] = {}
        self._filed: dict[str, tuple[int, bool]] = {}
        self._kinds: dict[str, tuple[str, ...]] = {}
        # (share key, card model) -> room decile (free commitment // 10) -> nodes that have
        # a partly booked card of that tenant / sharing group with that much room
        self._partial: dict[tuple[str, str], dict[int, dict[str, NodeView]]] = {}
        self._partial_of: dict[str, list[tuple[tuple[str, str], int]]] = {}
        self._capped: set[str] = set()  # at the inference container cap
        self._card_mb: dict[str, int] = {}  # card model -> largest card of it
        self._vendor: dict[str, str] = {}  # card model -> vendor
        for n in nodes:
            for m in n.models:
                self._models.setdefault(m, []).append(n)
            kinds = tuple(sorted({c.model for c in n.cards}))
            for c in n.cards:
                self._card_mb[c.model] = max(self._card_mb.get(c.model, 0), c.memory_total_mb)
                self._vendor[c.model] = c.vendor
            self._kinds[n.id] = kinds
            if not kinds:
                self._cpu.append(n)
            self._file(n)

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
        self._file(n)

    def _kinds_for(self, t: TaskDemand) -> list[str]:
        """Card models the task's engine drives whose cards can hold its estimate,
        smallest first (best fit), then the rest (tried last, for the reason)."""
        fits = sorted(
            (
                m
                for m, mb in self._card_mb.items()
                if mb >= t.estimated_gpu_memory_mb
                and (not t.engine_vendors or self._vendor[m] in t.engine_vendors)
            ),
            key=lambda m: (self._card_mb[m], m),
        )
        return fits + sorted(m for m in self._card_mb if m not in fits)

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
        for n in self.nodes:
            if n.id in seen:
                continue
            if not n.visible_to(t.tenant_id):
                why = f.RESERVED
            elif n.id in gated:
                why = f.OFFLINE if not n.online else f.OVERLOADED
            elif n.id in capped:
                why = f.CONTAINER_CAP
            else:
                why = self._ruled_out(n, t)
            if why:
                bulk[why] = bulk.get(why, 0) + 1
            else:
                yield n
        yield Tally(bulk)

    def _ruled_out(self, n: NodeView, t: TaskDemand) -> str:
        kinds = self._kinds[n.id]
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

        if t.model_path:
            yield from fresh(self._models.get(t.model_path, ()))
        if t.gpu_required == 0:
            yield from fresh(self._cpu)
            return
        kinds = [t.gpu_type] if t.gpu_type else self._kinds_for(t)
        if not t.whole and t.share_key:  # stack on the tenant's partly booked cards
            least = t.gpu_memory_utilization // 10
            for k in kinds:
                rooms = self._partial.get((t.share_key, k), {})
                for room in sorted((r for r in rooms if r >= least), reverse=not self.pack):
                    yield from fresh(rooms[room].values())
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
