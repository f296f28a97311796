"""Wire schemas of inference endpoints and model routes."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from heteroflow.schemas.common import Strict


class EndpointRead(BaseModel):
    id: str
    tenant_id: str
    group_id: str | None
    name: str
    port: int
    external_port: int
    key_prefix: str
    created_at: datetime
    updated_at: datetime


class EndpointUpdate(Strict):
    rotate_key: bool = False
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    external_port: int | None = Field(default=None, ge=0, le=65535)


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


class ModelRouteUpdate(Strict):
    priority: int | None = Field(default=None, le=1000000)
    weight: int | None = None
    version: str | None = Field(default=None, min_length=1, max_length=64)
    active: bool | None = None
    algorithm: str | None = None
