"""Inference endpoints (keys) and model routes after creation: list, update, rotate, delete.

An endpoint's name in its tenant, its key, and a route (tenant, model name, group) are
unique in the database: a rename, a chosen key or a route added at the same moment as
another one of the same answers 409 naming the field (services/unique.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.core.ids import key_display_prefix, new_api_key, new_id
from heteroflow.db.tables import InferenceEndpoint, ModelRoute, TaskGroup, Tenant
from heteroflow.schemas.gateway import (
    EndpointRead,
    EndpointUpdate,
    EndpointUpdated,
    ModelRouteCreate,
    ModelRouteRead,
    ModelRouteUpdate,
)
from heteroflow.schemas.routing import ALGORITHMS, hash_key
from heteroflow.services.identity.access import (
    endpoint_clause,
    route_clause,
    visible_endpoint,
    visible_group,
    visible_route,
)
from heteroflow.services.identity.auth import Principal
from heteroflow.services.serving.capabilities import group_capabilities
from heteroflow.services.tenancy.sharing import SharingLookupFailed, sharing_peers  # issue 16 (L4)
from heteroflow.services.unique import taken_as
from heteroflow.services.views import endpoint_read, route_read

# A key chosen by its owner (set_endpoint_key): long enough to be a secret, and only
# characters a Bearer header carries as they are (RFC 6750's token68, without padding).
CHOSEN_KEY = re.compile(r"[A-Za-z0-9._~+/-]{20,256}")


def foreign_groups(s: Session, who: Principal, group_ids: Iterable[str | None]) -> set[str]:
    """The groups among ``group_ids`` that are another tenant's (issue 26): a member's
    routes and keys to a service shared with its tenant (dedup, or an operator's route)
    read with an empty ``group_id`` — whose service it is stays the operator's to see."""
    ids = {g for g in group_ids if g}
    if who.is_operator or not ids:
        return set()
    q = select(TaskGroup.id).where(TaskGroup.id.in_(ids), TaskGroup.tenant_id != who.tenant_id)
    return set(s.scalars(q))


def _endpoint_read(s: Session, who: Principal, e: InferenceEndpoint) -> EndpointRead:
    return endpoint_read(e, shared=bool(foreign_groups(s, who, [e.group_id])))


def _route_read(s: Session, who: Principal, r: ModelRoute) -> ModelRouteRead:
    return route_read(r, shared=bool(foreign_groups(s, who, [r.group_id])))


def list_endpoints(s: Session, who: Principal) -> list[EndpointRead]:
    q = (
        select(InferenceEndpoint)
        .where(endpoint_clause(who))
        .order_by(InferenceEndpoint.created_at)
    )
    found = list(s.scalars(q))
    foreign = foreign_groups(s, who, (e.group_id for e in found))
    return [endpoint_read(e, shared=e.group_id in foreign) for e in found]


def update_endpoint(
    s: Session, who: Principal, clock: Clock, endpoint_id: str, req: EndpointUpdate
) -> EndpointUpdated:
    e = visible_endpoint(s, who, endpoint_id)
    if req.name is not None and req.name != e.name:
        clash = s.scalar(
            select(InferenceEndpoint.id).where(
                InferenceEndpoint.tenant_id == e.tenant_id, InferenceEndpoint.name == req.name
            )
        )
        taken = Conflict(f"an endpoint named {req.name!r} already exists", field="name")
        if clash is not None:
            raise taken
        with taken_as(s, taken):
            e.name = req.name
    if req.external_port is not None:
        e.external_port = req.external_port
    _apply_limits(e, req)
    key: str | None = None
    if req.rotate_key:
        key = new_api_key()
        e.key_hash = hash_key(key)
        e.key_prefix = key_display_prefix(key)
    e.updated_at = clock.now()
    s.flush()
    return EndpointUpdated(**_endpoint_read(s, who, e).model_dump(), api_key=key)


def set_endpoint_key(
    s: Session, who: Principal, clock: Clock, endpoint_id: str, key: str
) -> EndpointRead:
    """Give an endpoint a key its owner chose (``heteroflow up`` keeps its demo's key
    across restarts in a file). Stored like every key: sha256 and display prefix only.

    The key must be 20-256 characters of ``A-Z a-z 0-9 . _ ~ + / -`` and not be
    another endpoint's key.
    """
    if not CHOSEN_KEY.fullmatch(key):
        raise ValidationFailed(
            "a key has 20 to 256 characters, letters, digits and . _ ~ + / - only",
            field="api_key",
        )
    e = visible_endpoint(s, who, endpoint_id)
    digest = hash_key(key)
    clash = s.scalar(
        select(InferenceEndpoint.id).where(
            InferenceEndpoint.key_hash == digest, InferenceEndpoint.id != e.id
        )
    )
    taken = Conflict("another endpoint has this key", field="api_key")
    if clash is not None:
        raise taken
    with taken_as(s, taken):
        e.key_hash = digest
    e.key_prefix = key_display_prefix(key)
    e.updated_at = clock.now()
    s.flush()
    return _endpoint_read(s, who, e)


def _apply_limits(e: InferenceEndpoint, req: EndpointUpdate) -> None:
    """M8: per-key limits; 0 clears one. A quota needs its period (UTC day or month)."""
    for name in ("rpm_limit", "tpm_limit", "quota_tokens", "quota_period"):
        value = getattr(req, name)
        if value is not None:
            setattr(e, name, value)
    if (e.quota_tokens or 0) > 0 and e.quota_period not in ("day", "month"):
        raise ValidationFailed(
            "quota_tokens needs quota_period 'day' or 'month'", field="quota_period"
        )


def delete_endpoint(s: Session, who: Principal, endpoint_id: str) -> None:
    e = visible_endpoint(s, who, endpoint_id)
    if e.group_id is not None:
        g = s.get(TaskGroup, e.group_id)
        if g is not None and g.endpoint_id == e.id:
            g.endpoint_id = None  # no dangling reference (A1)
    s.delete(e)


def _check_route_fields(
    who: Principal, priority: int | None, weight: int | None, algorithm: str | None
) -> None:
    if priority is not None and priority < 0 and not who.is_operator:
        raise ValidationFailed(
            "priority must be >= 0 (0 is the highest); negative values are for operators",
            field="priority",
        )
    if weight is not None and not 0 <= weight <= 100:
        raise ValidationFailed("weight must be between 0 and 100", field="weight")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValidationFailed(
            f"algorithm must be one of {', '.join(ALGORITHMS)}", field="algorithm"
        )


def lock_live_group(s: Session, group_id: str, now: datetime) -> bool:
    """Write-lock a group that is not deleted, in this transaction (False: it is gone).

    Route creation and group deletion serialise on this row: a delete writes
    ``deleted_at`` first, so a route insert either commits before the delete (whose
    later read of the group's routes then sees it and deletes it) or waits for the
    delete's commit and finds the group gone. PostgreSQL: the row lock; SQLite: the
    first write of a transaction takes the database's write lock.
    """
    moved = s.execute(
        update(TaskGroup)
        .where(TaskGroup.id == group_id, TaskGroup.deleted_at.is_(None))
        .values(updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(moved, "rowcount", 0))


def _require_shared(s: Session, tenant_id: str, g: TaskGroup) -> None:
    """L4 (issue 16): a tenant is routed to another tenant's service only when both are
    in one sharing group (an operator's configuration); a lookup error refuses too."""
    try:
        peers = sharing_peers(s, g.tenant_id)
    except SharingLookupFailed:
        raise Conflict(
            f"the sharing groups of tenants {tenant_id} and {g.tenant_id} could not be "
            "read, so this cross-tenant route is refused (fail-closed); retry",
            field="tenant_id",
        ) from None
    if tenant_id not in peers:
        raise Conflict(
            f"tenant {tenant_id} and tenant {g.tenant_id} (which owns {g.id}) share no "
            "sharing group: a route to another tenant's service needs both in one "
            "(POST /api/v1/sharing-groups/{id}/tenants)",
            field="tenant_id",
        )


def create_route(
    s: Session, who: Principal, clock: Clock, req: ModelRouteCreate
) -> ModelRouteRead:
    """Add a route for a tenant (A3, M3): every key of the tenant may call the model.

    A second group under an existing model name is how a canary starts (M3: priority
    and weight decide the split). Members route to the groups they see (their tenant's;
    own-only members, N5: the ones they created; services/identity/access.py); an
    operator may route a tenant to another tenant's group when both are in one sharing
    group (a model shared with that tenant; L4), else 409 naming ``tenant_id``.
    """
    tenant_id = req.tenant_id or who.tenant_id
    if req.tenant_id and not who.is_operator and req.tenant_id != who.tenant_id:
        raise NotFound(f"tenant {req.tenant_id!r} not found")
    if s.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    g = visible_group(s, who, req.group_id)
    if tenant_id != g.tenant_id:  # an operator routing a tenant to another's service
        _require_shared(s, tenant_id, g)
    _check_route_fields(who, req.priority, req.weight, req.algorithm)
    now = clock.now()
    if not lock_live_group(s, g.id, now):  # deleted since the read above
        raise NotFound(f"task group {req.group_id!r} not found")
    clash = s.scalar(
        select(ModelRoute.id).where(
            ModelRoute.tenant_id == tenant_id,
            ModelRoute.model_name == req.model_name,
            ModelRoute.group_id == req.group_id,
        )
    )
    if clash is not None:
        raise _route_taken(req, clash)
    r = ModelRoute(
        id=new_id("mr"), tenant_id=tenant_id, group_id=g.id, model_name=req.model_name,
        priority=req.priority, weight=req.weight, version=req.version, active=True,
        algorithm=req.algorithm, tags=sorted(set(req.tags)), added=True,
        created_at=now, updated_at=now,
    )
    # the group's lock above orders two adds of one route already; the unique index
    # (0015) holds it for any other writer
    with taken_as(s, _route_taken(req)):
        s.add(r)
    return route_read(r)


def _route_taken(req: ModelRouteCreate, route_id: str | None = None) -> Conflict:
    which = f" ({route_id})" if route_id else ""
    return Conflict(
        f"model {req.model_name!r} already routes to {req.group_id} in this tenant"
        f"{which}; change that route instead",
        field="model_name",
    )


def delete_route(s: Session, who: Principal, route_id: str) -> None:
    r = visible_route(s, who, route_id)
    if not r.added:
        g = s.get(TaskGroup, r.group_id)
        if g is not None and g.model_name != r.model_name:  # core.lora: an adapter's route
            raise Conflict(
                f"this route serves LoRA adapter {r.model_name!r} of {r.group_id}; remove "
                f"the adapter (DELETE /api/v1/task-groups/{r.group_id}/adapters/"
                f"{r.model_name}) or deactivate the route (active: false)",
                field="route_id",
            )
        raise Conflict(
            "this route was created with its task group and goes with it; deactivate it "
            "(active: false) or delete the group",
            field="route_id",
        )
    s.delete(r)


def update_route(
    s: Session, who: Principal, clock: Clock, route_id: str, req: ModelRouteUpdate
) -> ModelRouteRead:
    r = visible_route(s, who, route_id)
    _check_route_fields(who, req.priority, req.weight, req.algorithm)
    if req.priority is not None:
        r.priority = req.priority
    if req.weight is not None:
        r.weight = req.weight
    if req.algorithm is not None:
        r.algorithm = req.algorithm
    if req.version is not None:
        r.version = req.version
    if req.active is not None:
        r.active = req.active
    if req.tags is not None:
        r.tags = sorted(set(req.tags))  # M10 capability tags (model=auto)
    r.updated_at = clock.now()
    s.flush()
    return _route_read(s, who, r)


def list_routes(s: Session, who: Principal, group_id: str | None = None) -> list[ModelRouteRead]:
    q = select(ModelRoute).where(route_clause(who)).order_by(ModelRoute.created_at)
    if group_id:
        q = q.where(ModelRoute.group_id == group_id)
    routes = list(s.scalars(q))
    capabilities = group_capabilities(s, {r.group_id for r in routes})  # issue 15
    foreign = foreign_groups(s, who, (r.group_id for r in routes))  # issue 26
    return [
        route_read(r, capabilities[r.group_id], shared=r.group_id in foreign) for r in routes
    ]
