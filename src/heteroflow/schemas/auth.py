"""Wire schemas of login, tenants and users."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.core.quotas import MAX_CARDS, MAX_CPU_MEMORY_MB, MAX_REPLICAS, MAX_SERVICES
from heteroflow.schemas.common import IdStr, SafeStr, Strict


class LoginRequest(Strict):
    username: SafeStr = Field(min_length=1, max_length=128)
    password: SafeStr = Field(min_length=1, max_length=1024)


class LoginResponse(BaseModel):
    access_token: str
    token_type: str = "bearer"  # noqa: S105 - the OAuth token type, not a secret
    expires_in: int


MAX_TENANT_TOKENS = 10**15  # as a key's quota_tokens (schemas/gateway.py)
PRIORITY_CEILING_DOC = "the highest task-group priority (0-1000) a member of it may set"


class TenantCreate(Strict):
    name: SafeStr = Field(max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    priority_ceiling: int = Field(default=100, ge=0, le=1000, description=PRIORITY_CEILING_DOC)
    sharing_group_id: IdStr | None = None


class TenantUpdate(Strict):
    """Operators only. Fields left out stay; ``sharing_group_id: null`` leaves the group."""

    priority_ceiling: int | None = Field(default=None, ge=0, le=1000)
    sharing_group_id: IdStr | None = None
    # N2 quotas: 0 or null = no limit
    quota_cards: int | None = Field(
        default=None, ge=0, le=MAX_CARDS,
        description="whole GPU cards by commitment (two services at 50% of one card = 1)",
    )
    quota_services: int | None = Field(
        default=None, ge=0, le=MAX_SERVICES, description="live services (task groups)"
    )
    quota_replicas: int | None = Field(
        default=None, ge=0, le=MAX_REPLICAS, description="tasks of those services"
    )
    quota_cpu_memory_mb: int | None = Field(
        default=None, ge=0, le=MAX_CPU_MEMORY_MB,
        description="memory booked by CPU work (gpu_required 0; 1024 MB when unset)",
    )
    # issue 16: the tenant's gateway tokens per period, beside each key's own budget
    quota_tokens: int | None = Field(
        default=None, ge=0, le=MAX_TENANT_TOKENS,
        description="gateway tokens per quota_token_period (0 = no limit); needs the period",
    )
    quota_token_period: Literal["day", "month", ""] | None = Field(
        default=None, description="UTC day or month of quota_tokens"
    )
    # N5: members see and manage only the services (and keys) they created
    members_see_own: bool | None = Field(
        default=None,
        description="members see and manage only what they created (operators: all)",
    )


QUOTA_FIELDS = ("quota_cards", "quota_services", "quota_replicas", "quota_cpu_memory_mb")


class TenantRead(BaseModel):
    id: str
    name: str
    priority_ceiling: int
    sharing_group_id: str | None
    quota_cards: int = 0  # 0 = no limit
    quota_services: int = 0
    quota_replicas: int = 0
    quota_cpu_memory_mb: int = 0
    quota_tokens: int = 0  # per quota_token_period; 0 = no limit
    quota_token_period: str = ""  # day | month | ""
    members_see_own: bool = False
    created_at: datetime


class QuotaAmounts(BaseModel):
    cards: float  # by commitment: a card at 50% counts 0.5
    services: int
    replicas: int
    cpu_memory_mb: int


class TenantQuotaRead(BaseModel):
    """``GET /api/v1/tenants/{id}/quota``: limits (0 = no limit) and what is held."""

    tenant_id: str
    tenant_name: str
    limits: QuotaAmounts
    usage: QuotaAmounts


class UserCreate(Strict):
    username: SafeStr = Field(max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
    password: SafeStr = Field(min_length=8, max_length=1024)
    # tenant_admin: a member who also manages their tenant's registry credentials (H7)
    role: Literal["operator", "member", "tenant_admin"] = "member"
    tenant_id: IdStr | None = Field(default=None, description="default: the caller's tenant")


class UserRead(BaseModel):
    id: str
    username: str
    role: str
    tenant_id: str
    created_at: datetime
