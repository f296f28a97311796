"""Tenants and users (/api/v1/tenants, /api/v1/users)."""

from __future__ import annotations

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.auth import (
    TenantCreate,
    TenantQuotaRead,
    TenantRead,
    TenantUpdate,
    UserCreate,
    UserRead,
)
from heteroflow.schemas.common import IdStr
from heteroflow.services.tenancy import quotas, tenants

router = api_router(prefix="/api/v1", tags=["tenants"])


@router.post("/tenants", response_model=TenantRead, status_code=201)
def create_tenant(req: TenantCreate, ctx: Ctx, s: DB, who: Who) -> TenantRead:
    return tenants.create_tenant(s, who, ctx.clock, req)


@router.get("/tenants", response_model=list[TenantRead])
def list_tenants(s: DB, who: Who) -> list[TenantRead]:
    return tenants.list_tenants(s, who)


@router.patch("/tenants/{tenant_id}", response_model=TenantRead)
def update_tenant(tenant_id: IdStr, req: TenantUpdate, s: DB, who: Who) -> TenantRead:
    return tenants.update_tenant(s, who, tenant_id, req)


@router.get("/tenants/{tenant_id}/quota", response_model=TenantQuotaRead)
def read_quota(tenant_id: IdStr, s: DB, who: Who) -> TenantQuotaRead:
    """N2: the tenant's limits (0 = no limit) and what it holds; members their own."""
    return quotas.read_quota(s, who, tenant_id)


@router.post("/users", response_model=UserRead, status_code=201)
def create_user(req: UserCreate, ctx: Ctx, s: DB, who: Who) -> UserRead:
    return tenants.create_user(s, who, ctx.clock, req)


@router.get("/users", response_model=list[UserRead])
def list_users(s: DB, who: Who) -> list[UserRead]:
    return tenants.list_users(s, who)
