"""Sharing groups (N3): tenants whose work may share a GPU card (B5's red line).

A card holds the work of one tenant, or of the tenants of one sharing group. Groups
are managed by operators only; a tenant is in at most one group (one column on the
tenant). Joining is a compare-and-set from "no group", so two operators adding one
tenant to two groups at once cannot both succeed; moving a tenant is explicit (remove
then add, or ``PATCH /tenants/{id}``). A group with members is not deleted (409 naming
them): the operator removes them first, knowing it changes where their work may go.
Leaving or joining never moves running work; it changes only later placements.
"""

from __future__ import annotations

import logging

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, Forbidden, NotFound
from heteroflow.core.ids import new_id
from heteroflow.db.tables import SharingGroup, Tenant
from heteroflow.schemas.sharing import (
    SharingGroupCreate,
    SharingGroupMember,
    SharingGroupRead,
    SharingGroupTenantAdd,
)
from heteroflow.services.identity.auth import Principal
from heteroflow.services.unique import taken_as

log = logging.getLogger(__name__)


def tenant_share_keys(s: Session) -> dict[str, str]:
    """tenant id -> its sharing key: its sharing group's id when in one, else its own id.

    Two tenants may put work on one card exactly when their keys are equal. Group ids
    (``sg-``) and tenant ids (``tn-``) never collide.
    """
    rows = s.execute(select(Tenant.id, Tenant.sharing_group_id))
    return {tenant_id: group_id or tenant_id for tenant_id, group_id in rows}


class SharingLookupFailed(Exception):
    """The sharing-group lookup failed: callers fail closed (no cross-tenant sharing)."""


def _read_peers(s: Session, tenant_id: str) -> frozenset[str]:
    group_id = s.scalar(select(Tenant.sharing_group_id).where(Tenant.id == tenant_id))
    if group_id is None:
        return frozenset()
    q = select(Tenant.id).where(Tenant.sharing_group_id == group_id, Tenant.id != tenant_id)
    return frozenset(s.scalars(q))


def sharing_peers(s: Session, tenant_id: str) -> frozenset[str]:
    """The other tenants of ``tenant_id``'s sharing group (empty: it is in none) — who
    may reuse its services and it theirs (L4; issue 16).

    Authorisation is the group membership an operator configured, read now. Any error
    reading it raises ``SharingLookupFailed`` (after rolling back only this read, so the
    caller's transaction goes on): callers fail closed, never open.
    """
    try:
        with s.begin_nested():
            return _read_peers(s, tenant_id)
    except SQLAlchemyError as exc:
        log.warning("sharing-group lookup for tenant %s failed", tenant_id, exc_info=True)
        raise SharingLookupFailed(
            f"the sharing group of tenant {tenant_id} could not be read"
        ) from exc


def _operator(who: Principal) -> None:
    if not who.is_operator:
        raise Forbidden("only a platform operator manages sharing groups")


def require_group(s: Session, group_id: str, field: str | None = None) -> SharingGroup:
    g = s.get(SharingGroup, group_id)
    if g is None:
        raise NotFound(f"sharing group {group_id!r} not found", field=field)
    return g


def _members(s: Session, group_id: str) -> list[Tenant]:
    q = select(Tenant).where(Tenant.sharing_group_id == group_id).order_by(Tenant.name)
    return list(s.scalars(q))


def _read(s: Session, g: SharingGroup) -> SharingGroupRead:
    return SharingGroupRead(
        id=g.id,
        name=g.name,
        tenants=[SharingGroupMember(id=t.id, name=t.name) for t in _members(s, g.id)],
        created_at=g.created_at,
    )


def create_group(
    s: Session, who: Principal, clock: Clock, req: SharingGroupCreate
) -> SharingGroupRead:
    _operator(who)
    taken = Conflict(f"sharing group {req.name!r} already exists", field="name")
    if s.scalar(select(SharingGroup.id).where(SharingGroup.name == req.name)) is not None:
        raise taken
    g = SharingGroup(id=new_id("sg"), name=req.name, created_at=clock.now())
    with taken_as(s, taken):  # a concurrent create of the same name loses here, not in a 500
        s.add(g)
    return _read(s, g)


def list_groups(s: Session, who: Principal) -> list[SharingGroupRead]:
    _operator(who)
    return [_read(s, g) for g in s.scalars(select(SharingGroup).order_by(SharingGroup.name))]


def get_group(s: Session, who: Principal, group_id: str) -> SharingGroupRead:
    _operator(who)
    return _read(s, require_group(s, group_id))


def delete_group(s: Session, who: Principal, group_id: str) -> None:
    _operator(who)
    g = require_group(s, group_id)
    members = _members(s, g.id)
    if members:
        names = ", ".join(f"{t.name} ({t.id})" for t in members)
        raise Conflict(
            f"sharing group {g.name!r} still has tenants: {names}; remove them first",
            field="tenants",
        )
    try:
        with s.begin_nested():  # a tenant added meanwhile: the foreign key refuses the delete
            s.delete(g)
    except IntegrityError:
        raise Conflict(
            f"a tenant joined sharing group {g.name!r} meanwhile; remove it first",
            field="tenants",
        ) from None


def _tenant(s: Session, tenant_id: str, field: str | None) -> Tenant:
    t = s.get(Tenant, tenant_id)
    if t is None:
        raise NotFound(f"tenant {tenant_id!r} not found", field=field)
    return t


def add_tenant(
    s: Session, who: Principal, group_id: str, req: SharingGroupTenantAdd
) -> SharingGroupRead:
    """Join from "no group" (compare-and-set); already a member is fine (idempotent)."""
    _operator(who)
    g = require_group(s, group_id)
    t = _tenant(s, req.tenant_id, "tenant_id")
    joined = s.execute(
        update(Tenant)
        .where(Tenant.id == t.id, Tenant.sharing_group_id.is_(None))
        .values(sharing_group_id=g.id)
    )
    if joined.rowcount == 0:  # type: ignore[attr-defined]
        s.refresh(t)
        if t.sharing_group_id != g.id:
            other = s.get(SharingGroup, t.sharing_group_id) if t.sharing_group_id else None
            where = f"{other.name!r} ({other.id})" if other else "another sharing group"
            raise Conflict(
                f"tenant {t.name!r} is already in sharing group {where}; a tenant is in at "
                "most one: remove it there first, or PATCH the tenant's sharing_group_id",
                field="tenant_id",
            )
    return _read(s, g)


def remove_tenant(s: Session, who: Principal, group_id: str, tenant_id: str) -> SharingGroupRead:
    _operator(who)
    g = require_group(s, group_id)
    t = _tenant(s, tenant_id, None)
    left = s.execute(
        update(Tenant)
        .where(Tenant.id == t.id, Tenant.sharing_group_id == g.id)
        .values(sharing_group_id=None)
    )
    if left.rowcount == 0:  # type: ignore[attr-defined]
        raise NotFound(f"tenant {t.name!r} is not in sharing group {g.name!r}")
    return _read(s, g)
