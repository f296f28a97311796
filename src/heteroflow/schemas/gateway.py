"""Wire schemas of inference endpoints and model routes."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints

from heteroflow.schemas.capabilities import CapabilitiesRead
from heteroflow.schemas.common import (
    ID_PATTERN,
    MAX_ID_LENGTH,
    MAX_INT32,
    IdStr,
    NameStr,
    SafeStr,
    Strict,
    no_nul,
)
from heteroflow.schemas.routing import DEFAULT_ALGORITHM
from heteroflow.schemas.task_groups import MODEL_NAME_PATTERN


class EndpointRead(BaseModel):
    id: str
    tenant_id: str
    group_id: str | None
    name: str
    port: int
    external_port: int
    key_prefix: str
    # M8 limits of the key; 0 = none. quota_tokens per quota_period ("day" | "month").
    rpm_limit: int = 0
    tpm_limit: int = 0
    quota_tokens: int = 0
    quota_period: str = ""
    created_at: datetime
    updated_at: datetime


class EndpointUpdate(Strict):
    rotate_key: bool = False
    name: NameStr | None = None
    external_port: int | None = Field(default=None, ge=0, le=65535)
    rpm_limit: int | None = Field(default=None, ge=0, le=1_000_000_000)
    tpm_limit: int | None = Field(default=None, ge=0, le=MAX_INT32)
    quota_tokens: int | None = Field(default=None, ge=0, le=1_000_000_000_000_000)
    quota_period: Literal["day", "month", ""] | None = None


class EndpointUpdated(EndpointRead):
    api_key: str | None = Field(default=None, description="the new key, shown only once")


class ModelRouteRead(BaseModel):
    id: str
    tenant_id: str
    group_id: str
    model_name: str
    priority: int
    weight: int
    version: str
    active: bool
    algorithm: str
    tags: list[str] = Field(default_factory=list)
    added: bool = False  # added for the tenant: every key of the tenant may call it
    # issue 15: what the group's model can answer (null fields: unknown)
    capabilities: CapabilitiesRead = Field(default_factory=CapabilitiesRead)


# A capability tag for model=auto (M10): "code", "long-context", "embedding", ...
RouteTag = Annotated[
    str,
    StringConstraints(max_length=32, pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$"),
    AfterValidator(no_nul),
]
# Route priority: lower is tried first; negative values are for operators.
ROUTE_PRIORITY_MAX = 1_000_000


class ModelRouteCreate(Strict):
    """A route added for a tenant: ``model_name`` served by ``group_id``'s replicas.

    Callable by every key of the tenant. Members add routes to their own tenant's
    groups; operators may add one for any tenant (``tenant_id``) to any group — a model
    shared with that tenant.
    """

    model_name: SafeStr = Field(max_length=256, pattern=MODEL_NAME_PATTERN)
    group_id: SafeStr = Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    tenant_id: IdStr | None = None
    priority: int = Field(default=0, ge=-ROUTE_PRIORITY_MAX, le=ROUTE_PRIORITY_MAX)
    weight: int = Field(default=100, ge=0, le=100)
    version: SafeStr = Field(default="v1", min_length=1, max_length=64)
    algorithm: SafeStr = Field(default=DEFAULT_ALGORITHM, max_length=32)
    tags: list[RouteTag] = Field(default_factory=list, max_length=16)


class ModelRouteUpdate(Strict):
    priority: int | None = Field(default=None, ge=-ROUTE_PRIORITY_MAX, le=ROUTE_PRIORITY_MAX)
    weight: int | None = Field(default=None, ge=0, le=100)
    version: SafeStr | None = Field(default=None, min_length=1, max_length=64)
    active: bool | None = None
    algorithm: SafeStr | None = Field(default=None, max_length=32)
    tags: list[RouteTag] | None = Field(default=None, max_length=16)
