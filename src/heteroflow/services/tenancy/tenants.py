"""Tenants and users (operators create both and change tenants; members see their own).

Tenant names and user names are unique in the database: of two creates of one name at
once, one commits and the other answers 409 naming the field (services/unique.py).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, Forbidden, NotFound, ValidationFailed
from heteroflow.core.ids import new_id
from heteroflow.db.tables import Tenant, User
from heteroflow.schemas.auth import (
    QUOTA_FIELDS,
    TenantCreate,
    TenantRead,
    TenantUpdate,
    UserCreate,
    UserRead,
)
from heteroflow.services.identity.auth import Principal
from heteroflow.services.identity.passwords import hash_password
from heteroflow.services.tenancy.sharing import require_group
from heteroflow.services.unique import taken_as


def _tenant_read(t: Tenant) -> TenantRead:
    return TenantRead.model_validate(t, from_attributes=True)


def _user_read(u: User) -> UserRead:
    return UserRead.model_validate(u, from_attributes=True)


def create_tenant(s: Session, who: Principal, clock: Clock, req: TenantCreate) -> TenantRead:
    if not who.is_operator:
        raise Forbidden("only a platform operator creates tenants")
    taken = Conflict(f"tenant {req.name!r} already exists", field="name")
    if s.scalar(select(Tenant).where(Tenant.name == req.name)) is not None:
        raise taken
    if req.sharing_group_id is not None:
        require_group(s, req.sharing_group_id, "sharing_group_id")
    t = Tenant(
        id=new_id("tn"),
        name=req.name,
        priority_ceiling=req.priority_ceiling,
        sharing_group_id=req.sharing_group_id,
        created_at=clock.now(),
    )
    with taken_as(s, taken):
        s.add(t)
    return _tenant_read(t)


def update_tenant(s: Session, who: Principal, tenant_id: str, req: TenantUpdate) -> TenantRead:
    """Operators set the priority ceiling and the quotas (N2; 0 or null = no limit),
    the tenant's token quota and its period (the gateway enforces it), whether members
    see only what they created (N5, services/identity/access.py) and move a tenant between
    sharing groups. A lower quota never stops what runs: it refuses the next growth
    (core/quotas.py)."""
    if not who.is_operator:
        raise Forbidden("only a platform operator changes tenants")
    t = s.get(Tenant, tenant_id)
    if t is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    if "priority_ceiling" in req.model_fields_set:
        if req.priority_ceiling is None:
            raise ValidationFailed(
                "priority_ceiling must be a number 0-1000", field="priority_ceiling"
            )
        t.priority_ceiling = req.priority_ceiling
    if "sharing_group_id" in req.model_fields_set:
        if req.sharing_group_id is not None:
            require_group(s, req.sharing_group_id, "sharing_group_id")
        t.sharing_group_id = req.sharing_group_id
    for name in QUOTA_FIELDS:
        if name in req.model_fields_set:
            setattr(t, name, getattr(req, name) or 0)
    _token_quota(t, req)
    if "members_see_own" in req.model_fields_set:
        if req.members_see_own is None:
            raise ValidationFailed("members_see_own must be true or false", field="members_see_own")
        t.members_see_own = req.members_see_own
    s.flush()
    return _tenant_read(t)


def _token_quota(t: Tenant, req: TenantUpdate) -> None:
    """The tenant's token quota (0 or null = no limit) needs its period, as a key's."""
    if "quota_tokens" in req.model_fields_set:
        t.quota_tokens = req.quota_tokens or 0
    if "quota_token_period" in req.model_fields_set:
        t.quota_token_period = req.quota_token_period or ""
    if (t.quota_tokens or 0) > 0 and t.quota_token_period not in ("day", "month"):
        raise ValidationFailed(
            "quota_tokens needs quota_token_period 'day' or 'month'", field="quota_token_period"
        )


def list_tenants(s: Session, who: Principal) -> list[TenantRead]:
    q = select(Tenant).order_by(Tenant.created_at)
    if not who.is_operator:
        q = q.where(Tenant.id == who.tenant_id)
    return [_tenant_read(t) for t in s.scalars(q)]


def create_user(s: Session, who: Principal, clock: Clock, req: UserCreate) -> UserRead:
    if not who.is_operator:
        raise Forbidden("only a platform operator creates users")
    tenant_id = req.tenant_id or who.tenant_id
    if s.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant {tenant_id!r} not found", field="tenant_id")
    taken = Conflict(f"user {req.username!r} already exists", field="username")
    if s.scalar(select(User).where(User.username == req.username)) is not None:
        raise taken
    u = User(
        id=new_id("usr"),
        username=req.username,
        password_hash=hash_password(req.password),
        role=req.role,
        tenant_id=tenant_id,
        created_at=clock.now(),
    )
    with taken_as(s, taken):
        s.add(u)
    return _user_read(u)


def list_users(s: Session, who: Principal) -> list[UserRead]:
    q = select(User).order_by(User.created_at)
    if not who.is_operator:
        q = q.where(User.tenant_id == who.tenant_id)
    return [_user_read(u) for u in s.scalars(q)]
