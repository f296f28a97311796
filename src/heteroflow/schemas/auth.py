"""Wire schemas of login, tenants and users."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.schemas.common import Strict


class LoginRequest(Strict):
    username: str = Field(min_length=1, max_length=128)
    password: str = Field(min_length=1, max_length=1024)


class LoginResponse(BaseModel):
    access_token: str
    token_type: str = "bearer"  # noqa: S105 - the OAuth token type, not a secret
    expires_in: int


class TenantCreate(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class TenantRead(BaseModel):
    id: str
    name: str
    created_at: datetime


class UserCreate(Strict):
    username: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
    password: str = Field(min_length=8, max_length=1024)
    role: Literal["operator", "member"] = "member"
    tenant_id: str | None = Field(default=None, description="default: the caller's tenant")


class UserRead(BaseModel):
    id: str
    username: str
    role: str
    tenant_id: str
    created_at: datetime
