"""The values the placement pipeline works on: plain data, no I/O.

A ``NodeView`` is the scheduler's picture of one node for one round: its cards with
what is booked on them, its load, what it holds (models, engines, labels) and the tasks
that occupy it (for sharing rules and preemption). ``TaskDemand`` is what one task
asks for. Booking a placement into the views (``book``) is how one round avoids
double-booking before anything is written; the database CAS guards across rounds and
across schedulers.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from heteroflow.core.engines.registry import is_cpu_build
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.model_sources import is_source_url, parse_model_source

DEFAULT_CPU_TASK_MEMORY_MB = 1024


@functools.lru_cache(maxsize=4096)
def source_text(model_path: str) -> str:
    """The canonical text of a model source (``core.model_sources``), "" for a path or
    text that does not parse (a create refuses it; an old row may hold it)."""
    if not is_source_url(model_path):
        return ""
    try:
        return parse_model_source(model_path).text
    except ValidationFailed:
        return ""
CPU_TASK_MEMORY_SHARE = 0.9  # CPU tasks may book up to 90% of a node's memory


@dataclass(frozen=True, slots=True)
class Reservation:
    """B3: memory kept free on every card: fixed MB plus a share of the card."""

    fixed_mb: int = 500
    ratio: float = 0.10

    def of(self, total_mb: int) -> int:
        return self.fixed_mb + int(total_mb * self.ratio)


@dataclass(frozen=True, slots=True)
class CachedCopy:
    """A model revision in a node's cache, as its heartbeat reported it (issue 29):
    ``source`` the canonical source text it was fetched for (``hf://org/name@main``),
    ``pinned`` the same at its resolved revision (``hf://org/name@<commit>``; the source
    itself when it has no revision), ``bytes`` on disk, or fetched so far while
    ``complete`` is False (a download in progress), ``key`` its cache key (the folder
    name, the same on every node that holds this revision)."""

    source: str
    pinned: str
    revision: str
    bytes: int
    complete: bool
    key: str = ""  # its cache key: ``fleet://<key>`` names this copy wherever it is

    @property
    def fleet(self) -> str:
        """The ``fleet://`` source text that names this copy ('' without a key)."""
        return f"fleet://{self.key}" if self.key else ""


def cached_copies(models: list[Any]) -> tuple[CachedCopy, ...]:
    """The node's cache as its heartbeat reported it (``agents.nodes.cached_entry``,
    issue 29): the entries of the ``models`` column that carry a ``source``."""
    out: list[CachedCopy] = []
    for m in models:
        if not isinstance(m, dict) or not m.get("source"):
            continue
        revision = str(m.get("revision") or "")
        texts = _source_texts(str(m["source"]), revision)
        if texts is None:  # stored by an older rule: not a copy anyone can match
            continue
        out.append(CachedCopy(
            source=texts[0], pinned=texts[1], revision=revision,
            bytes=int(m.get("size_bytes") or 0), complete=m.get("state") == "complete",
            key=str(m.get("key") or ""),
        ))
    return tuple(out)


@functools.lru_cache(maxsize=4096)  # a round reads every node's cache: parse once
def _source_texts(text: str, revision: str) -> tuple[str, str] | None:
    """(canonical text, the same pinned at ``revision``), or None when it does not parse."""
    try:
        source = parse_model_source(text)
    except ValidationFailed:
        return None
    return source.text, source.pinned(revision).text


@dataclass(slots=True)
class CardView:
    index: int
    vendor: str
    model: str
    memory_total_mb: int
    memory_used_mb: int = 0  # as the node measured it
    committed_mb: int = 0  # estimates of the tasks booked on it
    committed_pct: int = 0  # their gpu_memory_utilization, summed
    mig: bool = False
    mps: bool = False
    nvlink_peers: frozenset[int] = frozenset()
    holders: int = 0  # tasks booked on the card
    whole_holders: int = 0  # of them, tasks that own whole cards (TP, non-inference)
    inference: int = 0  # inference tasks on it
    sleeping: int = 0  # of them, sleeping ones (their memory is released)
    sleeping_mb: int = 0
    sleeping_pct: int = 0
    share_key: str = ""  # tenant (or sharing group) whose work is on it; "" = none

    @property
    def free(self) -> bool:
        return self.holders == 0 and self.committed_pct == 0 and self.committed_mb == 0

    def available_mb(self, reservation: Reservation, *, borrow: bool = False) -> int:
        committed = self.committed_mb - self.sleeping_mb if borrow else self.committed_mb
        used = self.memory_used_mb if self.memory_used_mb > committed else committed
        return self.memory_total_mb - used - reservation.of(self.memory_total_mb)


def may_use(dedicated_to: frozenset[str], tenant_id: str) -> bool:
    """A node dedicated to some tenants (empty: to none, i.e. shared) serves only them."""
    return not dedicated_to or not tenant_id or tenant_id in dedicated_to


@dataclass(slots=True)
class Occupant:
    """A task holding a placement on a node (for sharing rules and preemption)."""

    task_id: str
    group_id: str
    priority: int
    gpu_ids: tuple[int, ...]
    per_card_mb: int
    per_card_pct: int
    memory_mb: int
    share_key: str
    inference: bool
    whole: bool
    sleeping: bool = False
    preempting: bool = False  # already asked to make room for another task
    preemptible: bool = True  # False: never a preemption's victim (A2, B4)


@dataclass(slots=True)
class NodeView:
    """A node as one round sees it. Label ``heteroflow.tenants`` ("tn-a,tn-b") dedicates
    it to those tenants: no other tenant's work is placed there, nor sees it."""

    id: str
    name: str
    online: bool
    cards: list[CardView]
    cpu_count: int
    memory_total_mb: int
    memory_committed_mb: int = 0
    # memory the node reports really free now (0 = not reported), and what CPU tasks
    # booked that it cannot show yet (placed, engine not loaded): filters.cpu_room
    memory_available_mb: int = 0
    memory_unloaded_mb: int = 0
    # host ports taken: the node's bookings, plus what its agent reports listening (P2)
    ports_in_use: set[int] = field(default_factory=set)
    cpu_percent: float = 0.0
    memory_percent: float = 0.0
    inference_tasks: int = 0  # placed inference containers (sleeping ones count too)
    models: frozenset[str] = frozenset()  # paths and names of the models it holds
    cached_models: tuple[CachedCopy, ...] = ()  # its model cache (issue 29: sources)
    engines: frozenset[str] = frozenset()  # engines its probe reports available
    labels: dict[str, str] = field(default_factory=dict)
    occupants: list[Occupant] = field(default_factory=list)
    version: int = 0  # nodes.booking_version as read
    # tenants this node is dedicated to (label heteroflow.tenants); empty = every tenant
    tenants: frozenset[str] = frozenset()
    runtime: str = "docker"  # docker | process (the agent's runtime)
    address: str = ""  # where its agent publishes task ports (the heartbeat's address)
    # What the engine chain and the create-time checks read (filled by the one reader,
    # services/placement/fleet.py): engine name -> image as the probe reports it, the node's card
    # vendor as the chain sees it ("" = no GPU) and its cards' compute capabilities
    engine_images: dict[str, str] = field(default_factory=dict)
    vendor: str = ""
    compute_capabilities: tuple[str, ...] = ()
    # C4 volume rules the agent reports (absolute model paths must be inside)
    allowed_volume_prefixes: tuple[str, ...] = ()
    denied_volume_prefixes: tuple[str, ...] = ()

    def visible_to(self, tenant_id: str) -> bool:
        return may_use(self.tenants, tenant_id)

    def cpu_build(self, engine: str) -> bool:
        """Whether this node runs ``engine`` as a CPU-only build (vLLM's CPU build on a
        process-runtime node): it serves CPU tasks and drives no card."""
        return is_cpu_build(self.runtime, self.engine_images.get(engine))

    @property
    def rdma(self) -> bool:
        return self.labels.get("rdma", "").lower() in ("true", "1", "yes")

    @property
    def containerized(self) -> bool:
        return self.labels.get("heteroflow.containerized", "").lower() in ("true", "1", "yes")

    def clone(self) -> NodeView:
        """A copy whose cards and bookings can change without touching this view."""
        return dataclasses.replace(
            self,
            cards=[dataclasses.replace(c) for c in self.cards],
            ports_in_use=set(self.ports_in_use),
            occupants=list(self.occupants),
        )

    def free_cards(self) -> int:
        return sum(1 for c in self.cards if c.free)


@dataclass(frozen=True, slots=True)
class TaskDemand:
    task_id: str
    gpu_required: int
    gpu_type: str
    gpu_memory_utilization: int  # 1-100
    estimated_gpu_memory_mb: int
    memory_mb: int
    host_ports: tuple[int, ...]  # requested host ports, 0 = from the pool
    task_type: str = "inference"  # inference | training | container
    model_path: str = ""
    engine: str = ""
    share_key: str = ""  # tenant id, or its sharing group's id
    tenant_id: str = ""  # for nodes dedicated to some tenants ("" = not checked)
    priority: int = 0
    group_id: str = ""
    multi_node: bool = False  # a stage of a pipeline group (prefers RDMA nodes)
    # card vendors the task's engine runs on ("cpu" for CPU work); empty = no engine
    engine_vendors: frozenset[str] = frozenset()
    # "tenant": its priority ranks only within its share key; "platform" (operator-set):
    # it may preempt any tenant's lower-priority work
    priority_class: str = "tenant"
    # a custom command or an engine that exists only as an image: never on a node of
    # the process runtime (the trusted mode runs the platform's own launcher only)
    needs_container: bool = False
    # A2: the host side of its volumes, each under the node's volume rule (as model_path)
    host_paths: tuple[str, ...] = ()
    preemptible: bool = True  # False: never a preemption's victim (B4)
    # issue 29: the model's size in bytes when known (a create's resolve): what a node
    # without a copy downloads before the start (``scoring.download_s``)
    model_bytes: int = 0
    # derived once: the canonical text of ``model_path`` when it names a source, else ""
    model_source: str = field(init=False, repr=False, compare=False)
    # derived once (the pipeline reads them for every card it looks at)
    inference: bool = field(init=False, repr=False, compare=False)
    # Takes whole cards outside the percentage protocol (B6): TP replicas and all
    # non-inference work (training and plain containers never share a card).
    whole: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inference = self.task_type == "inference"
        object.__setattr__(self, "inference", inference)
        object.__setattr__(self, "whole", self.gpu_required > 1 or not inference)
        object.__setattr__(self, "model_source", source_text(self.model_path))

    @property
    def per_card_pct(self) -> int:
        return 100 if self.whole else self.gpu_memory_utilization


@dataclass(frozen=True, slots=True)
class Placement:
    node_id: str
    gpu_ids: tuple[int, ...]
    per_card_mb: int
    memory_mb: int
    host_ports: tuple[int, ...]
    per_card_pct: int = 0
    qos: str = ""
    borrowed: bool = False  # training on the cards of a sleeping inference service (F5)


@dataclass(frozen=True, slots=True)
class Unplaced:
    reason: str
    seen: int = 0  # nodes examined
    counts: tuple[tuple[str, int], ...] = ()  # reason key -> nodes, for re-explaining


def book(
    node: NodeView, p: Placement, t: TaskDemand, sign: int = 1, *, loaded: bool = False
) -> None:
    """Add (sign=1) or take back (sign=-1) a placement in the in-memory views.
    ``loaded``: the task's engine runs already, so the node's reported free memory
    shows its use (a new placement is not loaded)."""
    node.inference_tasks += sign * int(t.inference)
    if not loaded:
        node.memory_unloaded_mb += sign * p.memory_mb
    for c in node.cards:
        if c.index in p.gpu_ids:
            c.committed_mb += sign * p.per_card_mb
            c.committed_pct += sign * p.per_card_pct
            c.holders += sign
            c.whole_holders += sign * int(t.whole)
            c.inference += sign * int(t.inference)
            if c.holders == 0:
                c.share_key = ""
            elif sign > 0 and not c.share_key:
                c.share_key = t.share_key
    node.memory_committed_mb += sign * p.memory_mb
    if sign > 0:
        node.ports_in_use.update(p.host_ports)
        node.occupants.append(
            Occupant(
                t.task_id, t.group_id, t.priority, p.gpu_ids, p.per_card_mb, p.per_card_pct,
                p.memory_mb, t.share_key, t.inference, t.whole, preemptible=t.preemptible,
            )
        )
    else:
        node.ports_in_use.difference_update(p.host_ports)
        node.occupants = [o for o in node.occupants if o.task_id != t.task_id]


def unbook_occupant(node: NodeView, o: Occupant) -> None:
    """Take an occupant's booking out of a (copied) view: what preemption would free."""
    for c in node.cards:
        if c.index in o.gpu_ids:
            c.committed_mb -= o.per_card_mb
            c.committed_pct -= o.per_card_pct
            c.holders -= 1
            c.whole_holders -= int(o.whole)
            c.inference -= int(o.inference)
            if c.holders <= 0:
                c.holders = c.committed_mb = c.committed_pct = 0
                c.share_key = ""
    node.memory_committed_mb -= o.memory_mb
    node.inference_tasks -= int(o.inference)
    node.occupants = [x for x in node.occupants if x.task_id != o.task_id]
