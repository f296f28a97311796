"""One read model of the fleet: what a create, its dry run, the memory precheck and a
scheduler round know about the nodes.

``read_fleet`` reads the nodes once into ``NodeView``s: online by the one window
(``node_offline_after_s``), cards with what the tasks holding resources book on them,
engines (names and images), the card vendor and compute capabilities the engine chain
reads, volume prefixes (C4), runtime, labels and dedication. Nothing else reads the
``nodes`` table to judge a node, so a create and its dry run never disagree about
which nodes are online, what engines they report or what they could hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.engines.selection import NodeEngines
from heteroflow.core.placement import CardView, NodeView, Placement, TaskDemand, book
from heteroflow.core.placement.model import cached_copies
from heteroflow.core.ports import host_ports, ports_from_dicts
from heteroflow.core.states import HOLDS_RESOURCES, TaskStatus
from heteroflow.db.tables import Node, Task
from heteroflow.services.agents.nodes import dedicated_to, engines_from
from heteroflow.services.tenancy.sharing import tenant_share_keys


@dataclass(slots=True)
class Fleet:
    """The nodes as one read saw them (by id, in name order), and the sharing keys the
    bookings were made under (tenant id -> tenant or sharing group id)."""

    views: dict[str, NodeView]
    keys: dict[str, str]
    offline_after_s: float

    @property
    def nodes(self) -> list[NodeView]:
        return list(self.views.values())

    def share_key(self, tenant_id: str) -> str:
        return self.keys.get(tenant_id, tenant_id)


def engines_of(n: NodeView) -> NodeEngines:
    """The engine chain's input (H1, H2) for a node, from its view."""
    return NodeEngines(
        vendor=n.vendor,
        compute_capabilities=n.compute_capabilities,
        available=dict(n.engine_images),
    )


def read_fleet(
    s: Session, clock: Clock, offline_after_s: float, keys: dict[str, str] | None = None
) -> Fleet:
    """The fleet now: a node is online when its last heartbeat is at most
    ``offline_after_s`` old (the ``node_offline_after_s`` setting, for every caller)."""
    keys = tenant_share_keys(s) if keys is None else keys
    cutoff = clock.now() - timedelta(seconds=offline_after_s)
    views: dict[str, NodeView] = {}
    cols = (
        Node.id, Node.name, Node.gpus, Node.cpu_count, Node.memory_total_mb, Node.cpu_percent,
        Node.memory_percent, Node.models, Node.engines, Node.labels, Node.last_heartbeat_at,
        Node.booking_version, Node.runtime, Node.address, Node.allowed_volume_prefixes,
        Node.denied_volume_prefixes, Node.memory_available_mb, Node.host_ports_in_use,
    )
    for n in s.execute(select(*cols).order_by(Node.name)):
        chain = engines_from(n.gpus, n.engines)
        views[n.id] = NodeView(
            id=n.id,
            name=n.name,
            online=n.last_heartbeat_at >= cutoff,
            cards=[_card(g) for g in n.gpus],
            cpu_count=n.cpu_count,
            memory_total_mb=n.memory_total_mb,
            memory_available_mb=n.memory_available_mb,
            # what listens there now, whatever holds it; bookings are added below
            ports_in_use={int(p) for p in n.host_ports_in_use},
            cpu_percent=n.cpu_percent,
            memory_percent=n.memory_percent,
            models=frozenset(
                str(m.get(k, "")) for m in n.models for k in ("path", "name")
                if m.get(k) and not m.get("source")  # a cache entry: cached_models
            ),
            cached_models=cached_copies(n.models),
            engines=frozenset(chain.available),
            labels={str(k): str(v) for k, v in n.labels.items()},
            version=n.booking_version,
            tenants=dedicated_to(n.labels),
            runtime=n.runtime,
            address=n.address,
            engine_images=dict(chain.available),
            vendor=chain.vendor,
            compute_capabilities=chain.compute_capabilities,
            allowed_volume_prefixes=tuple(str(p) for p in n.allowed_volume_prefixes),
            denied_volume_prefixes=tuple(str(p) for p in n.denied_volume_prefixes),
        )
    _book_holders(s, views, keys)
    return Fleet(views, keys, offline_after_s)


# Holders whose engine has loaded: the node's reported free memory shows their use.
LOADED = frozenset({TaskStatus.RUNNING.value, TaskStatus.STOPPING.value})


def _book_holders(s: Session, views: dict[str, NodeView], keys: dict[str, str]) -> None:
    """Book the tasks that hold resources into their nodes' views."""
    held = select(
        Task.id, Task.group_id, Task.tenant_id, Task.node_id, Task.gpu_ids, Task.gpu_required,
        Task.gpu_memory_utilization, Task.estimated_gpu_memory_mb, Task.memory_mb,
        Task.task_type, Task.ports, Task.priority, Task.preempted_by, Task.status,
        Task.preemptible,
    ).where(Task.status.in_([st.value for st in HOLDS_RESOURCES]), Task.node_id.is_not(None))
    for t in s.execute(held):
        view = views.get(t.node_id or "")
        if view is None:
            continue
        d = TaskDemand(
            task_id=t.id, gpu_required=t.gpu_required, gpu_type="",
            gpu_memory_utilization=t.gpu_memory_utilization,
            estimated_gpu_memory_mb=t.estimated_gpu_memory_mb, memory_mb=t.memory_mb,
            host_ports=(), task_type=t.task_type, share_key=keys.get(t.tenant_id, t.tenant_id),
            priority=t.priority, group_id=t.group_id, preemptible=t.preemptible,
        )
        p = Placement(
            view.id, tuple(int(i) for i in t.gpu_ids), t.estimated_gpu_memory_mb,
            t.memory_mb if t.gpu_required == 0 else 0,
            host_ports(ports_from_dicts(t.ports), chosen_only=True),
            per_card_pct=d.per_card_pct,
        )
        book(view, p, d, loaded=t.status in LOADED)
        view.occupants[-1].preempting = bool(t.preempted_by)
        # F5: training may borrow the cards of a sleeping inference service
        if t.status == TaskStatus.SLEEPING.value:
            view.occupants[-1].sleeping = True
            for c in view.cards:
                if c.index in p.gpu_ids:
                    c.sleeping += 1
                    c.sleeping_mb += p.per_card_mb
                    c.sleeping_pct += p.per_card_pct


def _card(g: dict[str, Any]) -> CardView:
    # one call per card of the fleet each round (75,000 at 10,000 nodes): plain lookups
    mig = g.get("mig_enabled")
    peers = g.get("nvlink_peers")
    return CardView(
        index=int(g["index"]),
        vendor=str(g.get("vendor", "")),
        model=str(g.get("model", "")),
        memory_total_mb=int(g["memory_total_mb"]),
        memory_used_mb=int(g.get("memory_used_mb", 0)),
        # H5/B10: gold needs cards partitioned now, not merely able to be
        mig=bool(g.get("mig_capable", False) if mig is None else mig),
        mps=bool(g.get("mps_capable", False)),
        nvlink_peers=frozenset(map(int, peers)) if peers else frozenset(),
    )
