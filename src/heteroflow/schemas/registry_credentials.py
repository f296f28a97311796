"""Wire schemas of registry credentials (H7): the login a node's Docker pulls a private
image with. The password is write-only: no read model carries it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    model_validator,
)

from heteroflow.core.images import REGISTRY_HOST, normalise_host
from heteroflow.schemas.common import MAX_ID_LENGTH, Strict, no_nul, no_nul_secret


def _host(value: str) -> str:
    host = normalise_host(value)
    if not REGISTRY_HOST.match(host):
        raise ValueError(
            "a registry host is host[:port] (e.g. registry.example.com:5000 or docker.io), "
            "without a scheme or a path"
        )
    return host


RegistryHost = Annotated[
    str, StringConstraints(min_length=1, max_length=255), AfterValidator(no_nul),
    AfterValidator(_host),
]
# Docker's basic auth: a username never holds ':' (it separates it from the password)
Username = Annotated[
    str, StringConstraints(min_length=1, max_length=255, pattern=r"^[^:\s]+$"),
    AfterValidator(no_nul),
]
# at least 6 characters: shorter ones could not be told from ordinary words when the
# log redaction (logs.register_secrets) takes them out of every line
Password = Annotated[SecretStr, Field(min_length=6, max_length=4096), AfterValidator(no_nul_secret)]


TenantRef = Annotated[
    str, StringConstraints(max_length=MAX_ID_LENGTH, pattern=r"^[A-Za-z0-9._-]*$"),
    AfterValidator(no_nul),
]


class RegistryCredentialCreate(Strict):
    """``tenant_id``: whose credential — omitted: the caller's own tenant (an operator's
    omitted or "" is the platform's, used for every tenant without its own)."""

    registry_host: RegistryHost
    username: Username
    password: Password
    tenant_id: TenantRef | None = None


class RegistryCredentialUpdate(Strict):
    """A new username and/or password for the same registry and tenant."""

    username: Username | None = None
    password: Password | None = None

    @model_validator(mode="after")
    def _something(self) -> RegistryCredentialUpdate:
        if self.username is None and self.password is None:
            raise ValueError("give username, password or both")
        return self


class RegistryCredentialRead(BaseModel):
    """What anyone is ever shown of a credential: never its password."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: str = Field(description='"" = the platform\'s own, for tenants without one')
    registry_host: str
    username: str
    created_by: str
    created_at: datetime
    updated_at: datetime


class RegistryAuth(BaseModel):
    """The login for one pull, sent only to the agent of the node that claimed the task
    (its authenticated channel, as the engine key); never shown or logged."""

    username: str
    password: str = Field(repr=False)
