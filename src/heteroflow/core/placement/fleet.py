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
of other types. ``update`` re-files a node after a booking.
"""

from __future__ import annotations

from collections.abc import Iterator

from heteroflow.core.placement.model import NodeView, TaskDemand


class FleetIndex:
    def __init__(self, nodes: list[NodeView], *, pack: bool = True) -> None:
        self.nodes = nodes
        self.pack = pack
        self.by_id = {n.id: n for n in nodes}
        self._models: dict[str, list[NodeView]] = {}
        self._cpu: list[NodeView] = []
        # card model -> free-card count -> nodes (dicts keep insertion order)
        self._buckets: dict[str, dict[int, dict[str, NodeView]]] = {}
        self._free: dict[str, int] = {}
        self._kinds: dict[str, tuple[str, ...]] = {}
        self._partial: dict[str, dict[str, NodeView]] = {}  # share key -> nodes
        for n in nodes:
            for m in n.models:
                self._models.setdefault(m, []).append(n)
            kinds = tuple(sorted({c.model for c in n.cards}))
            self._kinds[n.id] = kinds
            if not kinds:
                self._cpu.append(n)
            self._file(n)

    def _file(self, n: NodeView) -> None:
        free = n.free_cards()
        self._free[n.id] = free
        for k in self._kinds[n.id]:
            self._buckets.setdefault(k, {}).setdefault(free, {})[n.id] = n
        for c in n.cards:
            if c.holders and not c.whole_holders and c.committed_pct < 100 and c.share_key:
                self._partial.setdefault(c.share_key, {})[n.id] = n

    def update(self, n: NodeView) -> None:
        old = self._free[n.id]
        for k in self._kinds[n.id]:
            self._buckets[k][old].pop(n.id, None)
        for nodes in self._partial.values():
            nodes.pop(n.id, None)
        self._file(n)

    def order(self, t: TaskDemand) -> Iterator[NodeView]:
        seen: set[str] = set()
        if t.model_path:
            for n in self._models.get(t.model_path, ()):
                seen.add(n.id)
                yield n
        if t.gpu_required == 0:
            for n in self._cpu + self.nodes:
                if n.id not in seen:
                    seen.add(n.id)
                    yield n
            return
        if not t.whole and t.share_key:
            for n in list(self._partial.get(t.share_key, {}).values()):
                if n.id not in seen:
                    seen.add(n.id)
                    yield n
        kinds = [t.gpu_type] if t.gpu_type else sorted(self._buckets)
        need = t.gpu_required
        for k in kinds:
            buckets = self._buckets.get(k, {})
            counts = sorted(buckets, reverse=not self.pack)
            first = [c for c in counts if c >= need] + [c for c in counts if c < need]
            for c in first:
                for n in list(buckets[c].values()):
                    if n.id not in seen:
                        seen.add(n.id)
                        yield n
        for n in self.nodes:  # nodes of other card types: counted in the reason only
            if n.id not in seen:
                seen.add(n.id)
                yield n
