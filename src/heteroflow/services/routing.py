"""Builds the gateway's routing snapshot from the database.

A backend is a task in ``running`` (its first health check passed) with a host port on a
node; keys map to the models routed to their endpoint's group. Deleted groups have no
routes and no endpoints, so their keys and models vanish with the next snapshot.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import InferenceEndpoint, ModelRoute, Node, Task
from heteroflow.gateway.snapshot import Backend, KeyEntry, RouteTarget, RoutingSnapshot


def build_snapshot(s: Session, version: int) -> RoutingSnapshot:
    routes = list(s.scalars(select(ModelRoute).where(ModelRoute.active.is_(True))))
    addresses = {n.id: n.address for n in s.scalars(select(Node))}
    backends: dict[str, list[Backend]] = defaultdict(list)
    for t in s.scalars(
        select(Task).where(Task.status == TaskStatus.RUNNING.value).order_by(Task.rank)
    ):
        host_port = next((p["host_port"] for p in t.ports if p.get("host_port")), 0)
        if not host_port or t.node_id not in addresses:
            continue  # a task without a port mapping is not a backend (A3)
        backends[t.group_id].append(
            Backend(task_id=t.id, base_url=f"http://{addresses[t.node_id]}:{host_port}")
        )

    by_model: dict[tuple[str, str], list[RouteTarget]] = defaultdict(list)
    models_of_group: dict[str, set[str]] = defaultdict(set)
    for r in routes:
        by_model[(r.tenant_id, r.model_name)].append(
            RouteTarget(
                route_id=r.id,
                group_id=r.group_id,
                priority=r.priority,
                weight=r.weight,
                backends=tuple(backends.get(r.group_id, ())),
                algorithm=r.algorithm or "round_robin",
            )
        )
        models_of_group[r.group_id].add(r.model_name)

    keys = {
        e.key_hash: KeyEntry(
            endpoint_id=e.id,
            tenant_id=e.tenant_id,
            group_id=e.group_id,
            models=frozenset(models_of_group.get(e.group_id or "", ())),
        )
        for e in s.scalars(select(InferenceEndpoint))
    }
    return RoutingSnapshot(
        version=version,
        keys=keys,
        routes={
            k: tuple(sorted(v, key=lambda t: (t.priority, -t.weight, t.route_id)))
            for k, v in by_model.items()
        },
    )
