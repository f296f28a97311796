"""The routing snapshot: everything the gateway needs to route, as plain immutable data.

The server builds it from the database (``services.routing``) and publishes it; the
gateway only reads it. In the all-in-one process it is handed over in memory through a
``SnapshotHolder``; a separate gateway process polls it over HTTP as JSON
(``GET /api/v1/gateway/snapshot``) and rebuilds the same objects with ``from_wire``.
The gateway never imports the database layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


def hash_key(plaintext: str) -> str:
    """sha256 hex of an API key: the only form in which keys are stored or compared."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Backend:
    """One routable engine replica: a running task that passed its first health check."""

    task_id: str
    base_url: str  # e.g. http://127.0.0.1:20123 (no trailing slash, no /v1)


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """A ModelRoute: model name -> one task group, with its backends."""

    route_id: str
    group_id: str
    priority: int
    weight: int
    backends: tuple[Backend, ...]
    # How a backend of this target is picked (M2): round_robin, random, least_connections
    # (engine_aware is served as least_connections for now; see gateway.balancing).
    algorithm: str = "round_robin"


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """What an API key may do, looked up by the key's sha256."""

    endpoint_id: str
    tenant_id: str
    group_id: str | None
    models: frozenset[str]  # model names this key may call


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    version: int
    keys: dict[str, KeyEntry] = field(default_factory=dict)  # sha256 -> entry
    # (tenant_id, model_name) -> route targets, best priority first
    routes: dict[tuple[str, str], tuple[RouteTarget, ...]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "keys": {
                h: {
                    "endpoint_id": k.endpoint_id,
                    "tenant_id": k.tenant_id,
                    "group_id": k.group_id,
                    "models": sorted(k.models),
                }
                for h, k in self.keys.items()
            },
            "routes": [
                {
                    "tenant_id": tenant,
                    "model_name": model,
                    "targets": [
                        {
                            "route_id": t.route_id,
                            "group_id": t.group_id,
                            "priority": t.priority,
                            "weight": t.weight,
                            "algorithm": t.algorithm,
                            "backends": [
                                {"task_id": b.task_id, "base_url": b.base_url} for b in t.backends
                            ],
                        }
                        for t in targets
                    ],
                }
                for (tenant, model), targets in self.routes.items()
            ],
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RoutingSnapshot:
        keys = {
            h: KeyEntry(
                endpoint_id=k["endpoint_id"],
                tenant_id=k["tenant_id"],
                group_id=k.get("group_id"),
                models=frozenset(k["models"]),
            )
            for h, k in data["keys"].items()
        }
        routes: dict[tuple[str, str], tuple[RouteTarget, ...]] = {}
        for r in data["routes"]:
            routes[(r["tenant_id"], r["model_name"])] = tuple(
                RouteTarget(
                    route_id=t["route_id"],
                    group_id=t["group_id"],
                    priority=t["priority"],
                    weight=t["weight"],
                    backends=tuple(
                        Backend(task_id=b["task_id"], base_url=b["base_url"])
                        for b in t["backends"]
                    ),
                    algorithm=t.get("algorithm", "round_robin"),
                )
                for t in r["targets"]
            )
        return cls(version=int(data["version"]), keys=keys, routes=routes)


EMPTY_SNAPSHOT = RoutingSnapshot(version=0)


class SnapshotHolder:
    """The current snapshot; swapped atomically (one attribute assignment)."""

    __slots__ = ("current",)

    def __init__(self, snapshot: RoutingSnapshot = EMPTY_SNAPSHOT) -> None:
        self.current = snapshot

    def publish(self, snapshot: RoutingSnapshot) -> None:
        self.current = snapshot
