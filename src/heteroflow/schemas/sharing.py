"""Wire schemas of sharing groups (N3): tenants whose work may share a GPU card."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from heteroflow.schemas.common import ID_PATTERN, MAX_ID_LENGTH, SafeStr, Strict

GROUP_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class SharingGroupCreate(Strict):
    name: SafeStr = Field(max_length=63, pattern=GROUP_NAME_PATTERN)


class SharingGroupTenantAdd(Strict):
    tenant_id: SafeStr = Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)


class SharingGroupMember(BaseModel):
    id: str
    name: str


class SharingGroupRead(BaseModel):
    id: str
    name: str
    tenants: list[SharingGroupMember] = Field(description="member tenants, by name")
    created_at: datetime
