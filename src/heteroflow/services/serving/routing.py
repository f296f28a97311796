"""Builds the gateway's routing snapshot from the database.

A backend is a task in ``running`` (its first health check passed) with a host port on a
node — of a pipeline group, rank 0 alone (the stages past it run headless, G1); a key may
call the models routed to its endpoint's group and the models of routes added for its
tenant (``POST /api/v1/model-routes``). Deleted groups have no
routes and no endpoints, so their keys and models vanish with the next snapshot.

A sleeping service stays listed (F6): its route target carries ``asleep`` ("sleeping",
or "waking" once a wake is under way) and only its running tasks as backends, so the
gateway can tell "asleep: wake it and hold the request" from "down: 503". Likewise a
target says how many of its group's current replicas are on their way up (M17:
``starting``, and since when), so that a request is held while they start rather than
refused; a group whose replicas all failed has none.

A LoRA adapter of a group (``core.lora``) is a route of its own name to the group, callable
by the group's keys like its model; the target says ``adapter`` so that the gateway
forwards the name unchanged.

Each target carries its group's capabilities (``services.capabilities``; issue 15), which
the gateway checks a request against before choosing a backend.

Each key carries its tenant's token quota (N2: ``Tenant.quota_tokens`` per
``quota_token_period``), which the gateway counts beside the key's own; a tenant without
one (0, or no valid period) has none.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.engines.registry import engine_slots
from heteroflow.core.gang import serves_api
from heteroflow.core.ports import host_ports, ports_from_dicts
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import InferenceEndpoint, ModelRoute, Node, Task, TaskGroup, Tenant
from heteroflow.schemas.routing import (
    UNNAMED_ALGORITHM,
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
)
from heteroflow.services.serving.capabilities import group_capabilities

# the periods of a token quota (the gateway's ``limits.PERIODS``), and "no quota"
TOKEN_PERIODS = ("day", "month")
NO_QUOTA = (0, "")
NONE_STARTING = (0, 0.0)
STARTING = (TaskStatus.PENDING.value, TaskStatus.SCHEDULED.value, TaskStatus.STARTING.value)


def build_snapshot(
    s: Session, version: int, engine_key: Callable[[str], str] | None = None
) -> RoutingSnapshot:
    """The routing snapshot of this moment; ``engine_key`` gives each backend the key its
    engine's door checks (C14; None: no key, for tests of routing alone)."""
    routes = list(s.scalars(select(ModelRoute).where(ModelRoute.active.is_(True))))
    running = Task.status == TaskStatus.RUNNING.value
    addresses: dict[str, str] = {}
    temperatures: dict[str, dict[int, int]] = {}  # node id -> card index -> °C
    # Only the nodes that host a backend, and only the columns routing needs: every
    # instance builds this twice a second, and reading (and decoding the cards of) every
    # node row is what held one server under 2,000 idle agents (bench/control_plane.py).
    hosts = select(Node.id, Node.address, Node.gpus).where(
        Node.id.in_(select(Task.node_id).where(running).distinct())
    )
    for node_id, address, gpus in s.execute(hosts):
        addresses[node_id] = address
        temperatures[node_id] = _card_temperatures(gpus)
    backends: dict[str, list[Backend]] = defaultdict(list)
    tasks = select(Task, TaskGroup.parallelism).join(TaskGroup, TaskGroup.id == Task.group_id)
    for t, parallelism in s.execute(tasks.where(running).order_by(Task.rank)):
        if not serves_api(parallelism, t.rank):
            continue  # G1: an inference gang answers on rank 0; the others run headless
        host_port = next(iter(host_ports(ports_from_dicts(t.ports), chosen_only=True)), 0)
        if not host_port or t.node_id not in addresses:
            continue  # a task without a port mapping is not a backend (A3)
        cards = temperatures[t.node_id]
        temps = [cards[i] for i in t.gpu_ids if i in cards]
        backends[t.group_id].append(
            Backend(
                task_id=t.id,
                base_url=f"http://{addresses[t.node_id]}:{host_port}",
                group_id=t.group_id,
                draining=bool(t.draining),
                temperature_c=max(temps) if temps else None,
                auth=f"Bearer {engine_key(t.id)}" if engine_key else "",
                # M16: a custom command is the whole line, as for the memory estimate
                slots=engine_slots(t.engine, t.command or t.engine_args),
            )
        )

    asleep = _asleep_groups(s)
    starting = _starting_groups(s)
    adapters = _adapter_routes(s)
    capabilities = group_capabilities(s, {r.group_id for r in routes})

    by_model: dict[tuple[str, str], list[RouteTarget]] = defaultdict(list)
    models_of_group: dict[str, set[str]] = defaultdict(set)
    added_for_tenant: dict[str, set[str]] = defaultdict(set)  # callable by all its keys
    for r in routes:
        by_model[(r.tenant_id, r.model_name)].append(
            RouteTarget(
                route_id=r.id,
                group_id=r.group_id,
                priority=r.priority,
                weight=r.weight,
                backends=tuple(backends.get(r.group_id, ())),
                algorithm=r.algorithm or UNNAMED_ALGORITHM,
                tags=tuple(str(tag) for tag in r.tags or ()),
                asleep=asleep.get(r.group_id, ""),
                capabilities=capabilities[r.group_id],
                adapter=r.id in adapters,
                starting=starting.get(r.group_id, NONE_STARTING)[0],
                starting_since=starting.get(r.group_id, NONE_STARTING)[1],
            )
        )
        if r.added:
            added_for_tenant[r.tenant_id].add(r.model_name)
        else:
            models_of_group[r.group_id].add(r.model_name)

    # N2: each tenant's token budget at the gateway, copied onto its keys (``KeyEntry``)
    tenant_quotas = {
        tid: (tokens, period)
        for tid, tokens, period in s.execute(
            select(Tenant.id, Tenant.quota_tokens, Tenant.quota_token_period).where(
                Tenant.quota_tokens > 0
            )
        )
        if period in TOKEN_PERIODS
    }
    keys = {
        e.key_hash: KeyEntry(
            endpoint_id=e.id,
            tenant_id=e.tenant_id,
            group_id=e.group_id,
            models=frozenset(models_of_group.get(e.group_id or "", ()))
            | frozenset(added_for_tenant.get(e.tenant_id, ())),
            rpm_limit=e.rpm_limit or 0,
            tpm_limit=e.tpm_limit or 0,
            quota_tokens=e.quota_tokens or 0,
            quota_period=e.quota_period or "",
            tenant_quota_tokens=tenant_quotas.get(e.tenant_id, NO_QUOTA)[0],
            tenant_quota_period=tenant_quotas.get(e.tenant_id, NO_QUOTA)[1],
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


def _adapter_routes(s: Session) -> set[str]:
    """The ids of routes that serve a LoRA adapter of their group (core.lora): made with
    the group (not ``added``) under another name than the group's model — the adapter API
    (``services.serving.adapters``) is the only writer of such routes."""
    q = (
        select(ModelRoute.id)
        .join(TaskGroup, TaskGroup.id == ModelRoute.group_id)
        .where(
            ModelRoute.active.is_(True),
            ModelRoute.added.is_(False),
            ModelRoute.model_name != TaskGroup.model_name,
        )
    )
    return set(s.scalars(q))


def _asleep_groups(s: Session) -> dict[str, str]:
    """Group id -> "waking" when a current task is waking, else "sleeping" when one
    sleeps (a task another replaced is history and does not count)."""
    out: dict[str, str] = {}
    for gid, status in s.execute(
        select(Task.group_id, Task.status).where(
            Task.status.in_((TaskStatus.SLEEPING.value, TaskStatus.WAKING.value)),
            Task.replaced_by == "",
        )
    ):
        if status == TaskStatus.WAKING.value or gid not in out:
            out[gid] = status
    return out


def _starting_groups(s: Session) -> dict[str, tuple[int, float]]:
    """Group id -> (current replicas on their way up, since when the longest-waiting one
    is: its last milestone — created, claimed, last running — in epoch seconds)."""
    out: dict[str, tuple[int, float]] = {}
    for gid, *times in s.execute(
        select(Task.group_id, Task.created_at, Task.started_at, Task.running_at).where(
            Task.status.in_(STARTING), Task.replaced_by == ""
        )
    ):
        since = max(t.timestamp() for t in times if t is not None)
        n, first = out.get(gid, (0, since))
        out[gid] = (n + 1, min(first, since))
    return out


def _card_temperatures(gpus: list[Any]) -> dict[int, int]:
    """Card index -> temperature (°C) from a node's last heartbeat; unknown ones left out."""
    out: dict[int, int] = {}
    for g in gpus:
        temp = g.get("temperature_c") if isinstance(g, dict) else None
        if isinstance(temp, int | float) and g.get("index") is not None:
            out[int(g["index"])] = int(temp)
    return out
