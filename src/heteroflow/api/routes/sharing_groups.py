"""Sharing groups of tenants (/api/v1/sharing-groups): operators only (N3)."""

from __future__ import annotations

from fastapi import Response

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.sharing import (
    SharingGroupCreate,
    SharingGroupRead,
    SharingGroupTenantAdd,
)
from heteroflow.services.tenancy import sharing

router = api_router(prefix="/api/v1/sharing-groups", tags=["sharing groups"])


@router.post("", response_model=SharingGroupRead, status_code=201)
def create_group(req: SharingGroupCreate, ctx: Ctx, s: DB, who: Who) -> SharingGroupRead:
    return sharing.create_group(s, who, ctx.clock, req)


@router.get("", response_model=list[SharingGroupRead])
def list_groups(s: DB, who: Who) -> list[SharingGroupRead]:
    return sharing.list_groups(s, who)


@router.get("/{group_id}", response_model=SharingGroupRead)
def get_group(group_id: IdStr, s: DB, who: Who) -> SharingGroupRead:
    return sharing.get_group(s, who, group_id)


@router.delete("/{group_id}", status_code=204)
def delete_group(group_id: IdStr, s: DB, who: Who) -> Response:
    sharing.delete_group(s, who, group_id)
    return Response(status_code=204)


@router.post("/{group_id}/tenants", response_model=SharingGroupRead)
def add_tenant(
    group_id: IdStr, req: SharingGroupTenantAdd, s: DB, who: Who
) -> SharingGroupRead:
    return sharing.add_tenant(s, who, group_id, req)


@router.delete("/{group_id}/tenants/{tenant_id}", response_model=SharingGroupRead)
def remove_tenant(group_id: IdStr, tenant_id: IdStr, s: DB, who: Who) -> SharingGroupRead:
    return sharing.remove_tenant(s, who, group_id, tenant_id)
