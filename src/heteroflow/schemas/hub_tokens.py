"""Wire schemas of hub tokens (issue 29 item 1, H9): a tenant's credential for a model
hub (Hugging Face, ModelScope), used to resolve and fetch its gated or private models.
The token is write-only: a read shows only its hint ("hf_…abcd")."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr

from heteroflow.schemas.common import Strict, no_nul_secret
from heteroflow.schemas.registry_credentials import TenantRef

#: The hubs a token is for: ``core.model_sources.SourceKind``'s hub kinds (a web server's
#: ``https://`` source never gets a token; a ``fleet://`` copy needs none).
Hub = Literal["hf", "modelscope"]
HUBS: tuple[str, ...] = ("hf", "modelscope")

def _one_word(value: SecretStr) -> SecretStr:
    if any(c.isspace() for c in value.get_secret_value()):
        raise ValueError("a token holds no whitespace")
    return value


# at least 8 characters: the log redaction (logs.register_secrets) takes it out of every
# line, which a short word could not be told apart for; no whitespace (it travels in a
# header or a cookie)
Token = Annotated[
    SecretStr,
    Field(min_length=8, max_length=4096),
    AfterValidator(no_nul_secret),
    AfterValidator(_one_word),
]


class HubTokenCreate(Strict):
    """``tenant_id``: whose token — omitted: the caller's own tenant (an operator's
    omitted or "" is the platform's, used for every tenant without its own)."""

    hub: Hub
    token: Token
    tenant_id: TenantRef | None = None


class HubTokenUpdate(Strict):
    """A new token for the same hub and tenant (a rotated or re-issued one)."""

    token: Token


class HubTokenRead(BaseModel):
    """What anyone is ever shown of a hub token: never the token itself."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: str = Field(description='"" = the platform\'s own, for tenants without one')
    hub: str = Field(description="hf | modelscope")
    token_hint: str = Field(
        description='the token\'s last 4 characters ("hf_…abcd"); "…" alone for a token '
        "shorter than 16 characters"
    )
    created_by: str
    created_at: datetime
    updated_at: datetime
