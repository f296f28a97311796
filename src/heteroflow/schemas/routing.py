"""The routing snapshot: everything the gateway needs to route, as plain immutable data.

Part of the server ↔ gateway contract, so it lives in ``schemas`` where both sides may
import it (the server's layers never import the gateway package). The server builds it
from the database (``services.routing``) and publishes it; the gateway only reads it.
In the all-in-one process it is handed over in memory through a ``SnapshotHolder``; a
separate gateway process polls it over HTTP as JSON (``GET /api/v1/gateway/snapshot``)
and rebuilds the same objects with ``from_wire``.

Sleep and wake (F4, F6) cross the same boundary: a route target says whether its group
is asleep (``RouteTarget.asleep``: listed, not routable), a backend names its group so
the gateway can report when each group last got a request (``GroupActivity``), and a
gateway asks the server to wake groups with ``WakeRequest`` and learns what happened
from one ``WakeOutcome`` per task.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, AwareDatetime, BaseModel, Field

from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities
from heteroflow.schemas.common import IdStr, SafeStr, Strict, to_utc

# How a route target's backend is picked (M2, M15; the policies: gateway.balancing). The
# one list of names: the routes file's field type and the API's check both read it.
Algorithm = Literal[
    "round_robin", "random", "least_connections", "engine_aware", "prefix_affinity", "capacity"
]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
# The algorithm of a new route that names none: one decision for the API, the routes
# file and the routes a service's creation adds. prefix_affinity since issue 30 measured
# it (docs/benchmarks.md: p90 TTFT 7x lower than least_connections on a shared-prefix
# trace); a prompt shorter than one block goes by least_connections, so short-prompt
# traffic is balanced as before.
DEFAULT_ALGORITHM: Algorithm = "prefix_affinity"
# What a route stored or sent without an algorithm was written to mean (a row or a
# snapshot from before algorithms were stored): round_robin, the default then.
UNNAMED_ALGORITHM: Algorithm = "round_robin"


def hash_key(plaintext: str) -> str:
    """sha256 hex of an API key: the only form in which keys are stored or compared."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Backend:
    """One routable engine replica: a running task that passed its first health check."""

    task_id: str
    base_url: str  # e.g. http://127.0.0.1:20123 (no trailing slash, no /v1)
    # F4: the task's group, whose last request time the gateway reports ("" = none: a
    # standalone routing file's backend)
    group_id: str = ""
    # M11: marked for draining (POST /api/v1/tasks/{id}/drain): no new requests
    draining: bool = False
    # M4: the hottest of the task's cards at the last heartbeat; None when unknown
    temperature_c: int | None = None
    # The Authorization header the backend wants ("Bearer ..."): a platform engine's own
    # key (C14: its door refuses anything else; on the snapshot's wire, which only
    # gateways read), or an external backend's key from a standalone routing file.
    # Never in a repr (so never in a log line).
    auth: str = field(default="", repr=False)
    # An external backend's key (routing file) stays in the process that read it: never
    # on the wire. An engine key travels to the gateways holding the gateway token.
    auth_local: bool = False
    # M16: the requests its engine runs at once, as its arguments set them
    # (``registry.engine_slots``; a routes file's ``slots``); 0: unknown, the gateway's
    # ``gateway_backend_concurrency`` stands in. The fair-share bound of its pool.
    slots: int = 0


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """A ModelRoute: model name -> one task group, with its backends."""

    route_id: str
    group_id: str
    priority: int
    weight: int
    backends: tuple[Backend, ...]
    # How a backend of this target is picked (M2): round_robin, random, least_connections,
    # engine_aware, prefix_affinity, capacity (M15; ``ALGORITHMS``, gateway.balancing).
    algorithm: str = UNNAMED_ALGORITHM
    # Capability tags for model=auto (M10), e.g. ("code", "long-context").
    tags: tuple[str, ...] = ()
    # F6: "sleeping" (a current task is asleep: a request wakes it), "waking" (one is on
    # its way up) or "" (neither). Such a target is listed but has no backend for the
    # tasks that sleep; the gateway holds requests for it until one is running.
    asleep: str = ""
    # Issue 15: what the group's model can answer (tools, images, embeddings, JSON schema,
    # context); unknown by default (a routes file, an older server's snapshot).
    capabilities: Capabilities = UNKNOWN
    # A LoRA adapter of the group (core.lora): its engines serve the name itself, so the
    # gateway forwards it unchanged (never renamed to the engine's first model id)
    adapter: bool = False
    # M17: the group's current replicas on their way up (pending, scheduled, starting:
    # placed, pulling, loading) and since when the longest-waiting one is (epoch seconds;
    # 0 = none). A target with no backend but such replicas holds its requests.
    starting: int = 0
    starting_since: float = 0.0


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """What an API key may do, looked up by the key's sha256."""

    endpoint_id: str
    tenant_id: str
    group_id: str | None
    models: frozenset[str]  # model names this key may call
    # M8 limits of the key's endpoint; 0 = none. quota_tokens per quota_period (day|month).
    rpm_limit: int = 0
    tpm_limit: int = 0
    quota_tokens: int = 0
    quota_period: str = ""
    # N2: the key's tenant's token budget, shared by all its keys (0 = none); on the
    # wire once per tenant (``tenant_quotas``), copied here so admission needs no lookup.
    tenant_quota_tokens: int = 0
    tenant_quota_period: str = ""


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    version: int
    keys: dict[str, KeyEntry] = field(default_factory=dict)  # sha256 -> entry
    # (tenant_id, model_name) -> route targets, best priority first
    routes: dict[tuple[str, str], tuple[RouteTarget, ...]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "version": self.version,
            "keys": {
                h: {
                    "endpoint_id": k.endpoint_id,
                    "tenant_id": k.tenant_id,
                    "group_id": k.group_id,
                    "models": sorted(k.models),
                    "rpm_limit": k.rpm_limit,
                    "tpm_limit": k.tpm_limit,
                    "quota_tokens": k.quota_tokens,
                    "quota_period": k.quota_period,
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
                            "tags": list(t.tags),
                            "asleep": t.asleep,
                            "capabilities": t.capabilities.to_wire(),
                            **({"adapter": True} if t.adapter else {}),
                            **(
                                {"starting": t.starting, "starting_since": t.starting_since}
                                if t.starting
                                else {}
                            ),
                            "backends": [
                                {
                                    "task_id": b.task_id,
                                    "base_url": b.base_url,
                                    "group_id": b.group_id,
                                    "draining": b.draining,
                                    "temperature_c": b.temperature_c,
                                    "auth": "" if b.auth_local else b.auth,
                                    **({"slots": b.slots} if b.slots else {}),
                                }
                                for b in t.backends
                            ],
                        }
                        for t in targets
                    ],
                }
                for (tenant, model), targets in self.routes.items()
            ],
        }
        # N2: {tenant_id: {"quota_tokens", "quota_period"}}, only tenants with a quota (and
        # only then the key: older gateways ignore it, older snapshots lack it)
        tenants = {
            k.tenant_id: {
                "quota_tokens": k.tenant_quota_tokens,
                "quota_period": k.tenant_quota_period,
            }
            for k in self.keys.values()
            if k.tenant_quota_tokens
        }
        if tenants:
            wire["tenant_quotas"] = tenants
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RoutingSnapshot:
        tenants = data.get("tenant_quotas") or {}
        keys = {
            h: KeyEntry(
                endpoint_id=k["endpoint_id"],
                tenant_id=k["tenant_id"],
                group_id=k.get("group_id"),
                models=frozenset(k["models"]),
                rpm_limit=int(k.get("rpm_limit", 0)),
                tpm_limit=int(k.get("tpm_limit", 0)),
                quota_tokens=int(k.get("quota_tokens", 0)),
                quota_period=str(k.get("quota_period", "")),
                tenant_quota_tokens=int(tenants.get(k["tenant_id"], {}).get("quota_tokens", 0)),
                tenant_quota_period=str(tenants.get(k["tenant_id"], {}).get("quota_period", "")),
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
                        Backend(
                            task_id=b["task_id"],
                            base_url=b["base_url"],
                            group_id=str(b.get("group_id", "")),
                            draining=bool(b.get("draining", False)),
                            temperature_c=b.get("temperature_c"),
                            auth=str(b.get("auth", "")),
                            slots=int(b.get("slots", 0)),
                        )
                        for b in t["backends"]
                    ),
                    algorithm=t.get("algorithm", "round_robin"),
                    tags=tuple(t.get("tags", ())),
                    asleep=str(t.get("asleep", "")),
                    capabilities=Capabilities.from_wire(t.get("capabilities")),
                    adapter=t.get("adapter") is True,
                    starting=int(t.get("starting", 0)),
                    starting_since=float(t.get("starting_since", 0.0)),
                )
                for t in r["targets"]
            )
        return cls(version=int(data["version"]), keys=keys, routes=routes)


EMPTY_SNAPSHOT = RoutingSnapshot(version=0)

# --- sleep and wake across the boundary (F4, F6) -------------------------------------

# The wake branches (``schemas.sleep.WakeBranch``) after which a held request keeps
# waiting: the task is on its way up, or already up and the snapshot is behind. Any
# other branch (node offline, card borrowed, container gone, failed) is answered at once.
HOLDING_BRANCHES: frozenset[str] = frozenset({"waking", "already_running", "starting"})
# The most groups one wake request names, and activity entries in one batch.
MAX_WAKE_GROUPS = 256
MAX_ACTIVITY_GROUPS = 100_000


@dataclass(frozen=True, slots=True)
class WakeOutcome:
    """What a wake did to one task of a group (the server's ``WakeResult``)."""

    group_id: str
    task_id: str
    branch: str
    message: str

    @property
    def holding(self) -> bool:
        return self.branch in HOLDING_BRANCHES

    def to_wire(self) -> dict[str, str]:
        return {
            "group_id": self.group_id,
            "task_id": self.task_id,
            "branch": self.branch,
            "message": self.message,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> WakeOutcome:
        return cls(
            group_id=str(data["group_id"]),
            task_id=str(data.get("task_id", "")),
            branch=str(data["branch"]),
            message=str(data.get("message", "")),
        )


class WakeRequest(Strict):
    """``POST /api/v1/gateway/wake``: a gateway asks for these groups to be woken."""

    group_ids: list[IdStr] = Field(min_length=1, max_length=MAX_WAKE_GROUPS)
    # the model the request named, for the events' wording
    model: SafeStr = Field(default="", max_length=256)


class WakeOutcomeRead(BaseModel):
    group_id: str
    task_id: str
    branch: str
    message: str


class WakeAnswer(BaseModel):
    results: list[WakeOutcomeRead]


class ActivityIn(Strict):
    """One group's last routed request, as a gateway saw it."""

    group_id: IdStr
    # an ISO 8601 string with its zone (JSON has no datetime type)
    last_request_at: Annotated[AwareDatetime, AfterValidator(to_utc)] = Field(strict=False)


class ActivityBatch(Strict):
    """``POST /api/v1/gateway/activity``: at most one entry per group per flush."""

    activity: list[ActivityIn] = Field(max_length=MAX_ACTIVITY_GROUPS)


class ActivityAccepted(BaseModel):
    updated: int


def activity_to_wire(activity: dict[str, datetime]) -> dict[str, Any]:
    return {
        "activity": [
            {"group_id": g, "last_request_at": t.isoformat()} for g, t in activity.items()
        ]
    }


class SnapshotHolder:
    """The current snapshot; swapped atomically (one attribute assignment)."""

    __slots__ = ("current",)

    def __init__(self, snapshot: RoutingSnapshot = EMPTY_SNAPSHOT) -> None:
        self.current = snapshot

    def publish(self, snapshot: RoutingSnapshot) -> None:
        self.current = snapshot
