"""Wire schemas of login, tenants and users."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.schemas.common import IdStr, SafeStr, Strict


class LoginRequest(Strict):
    username: SafeStr = Field(min_length=1, max_length=128)
    password: SafeStr = Field(min_length=1, max_length=1024)


class LoginResponse(BaseModel):
    access_token: str
    token_type: str = "bearer"  # noqa: S105 - the OAuth token type, not a secret
    expires_in: int


PRIORITY_CEILING_DOC = "the highest task-group priority (0-1000) a member of it may set"


class TenantCreate(Strict):
    name: SafeStr = Field(max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    priority_ceiling: int = Field(default=100, ge=0, le=1000, description=PRIORITY_CEILING_DOC)
    sharing_group_id: IdStr | None = None


class TenantUpdate(Strict):
    """Operators only. Fields left out stay; ``sharing_group_id: null`` leaves the group."""

    priority_ceiling: int | None = Field(default=None, ge=0, le=1000)
    sharing_group_id: IdStr | None = None


class TenantRead(BaseModel):
    id: str
    name: str
    priority_ceiling: int
    sharing_group_id: str | None
    created_at: datetime


class UserCreate(Strict):
    username: SafeStr = Field(max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
    password: SafeStr = Field(min_length=8, max_length=1024)
    role: Literal["operator", "member"] = "member"
    tenant_id: IdStr | None = Field(default=None, description="default: the caller's tenant")


class UserRead(BaseModel):
    id: str
    username: str
    role: str
    tenant_id: str
    created_at: datetime
