"""Hub tokens (/api/v1/hub-tokens, issue 29 item 1, H9): operators and tenant admins.

The token is write-only: every answer is ``HubTokenRead`` (hub, tenant, its hint, who,
when). The audit log records these writes without their bodies, as every write.
"""

from __future__ import annotations

from fastapi import Response

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.hub_tokens import HubTokenCreate, HubTokenRead, HubTokenUpdate
from heteroflow.services.tenancy import hub_tokens

router = api_router(prefix="/api/v1/hub-tokens", tags=["hub tokens"])


@router.post("", response_model=HubTokenRead, status_code=201)
def create_hub_token(req: HubTokenCreate, ctx: Ctx, s: DB, who: Who) -> HubTokenRead:
    """A token for one hub (``hf`` | ``modelscope``), the caller's tenant's (an operator:
    ``tenant_id``'s, or the platform's for every tenant without one). 409 when that
    tenant already has one for the hub."""
    return hub_tokens.create(s, ctx.clock, who, ctx.sealer, req)


@router.get("", response_model=list[HubTokenRead])
def list_hub_tokens(s: DB, who: Who) -> list[HubTokenRead]:
    """An operator's: every tenant's and the platform's; a tenant admin's: their own."""
    return hub_tokens.list_tokens(s, who)


@router.get("/{token_id}", response_model=HubTokenRead)
def get_hub_token(token_id: IdStr, s: DB, who: Who) -> HubTokenRead:
    return hub_tokens.get(s, who, token_id)


@router.patch("/{token_id}", response_model=HubTokenRead)
def update_hub_token(
    token_id: IdStr, req: HubTokenUpdate, ctx: Ctx, s: DB, who: Who
) -> HubTokenRead:
    """A new token for the same hub and tenant; the next create, dry run and claim use it."""
    return hub_tokens.update(s, ctx.clock, who, ctx.sealer, token_id, req)


@router.delete("/{token_id}", status_code=204)
def delete_hub_token(token_id: IdStr, s: DB, who: Who) -> Response:
    hub_tokens.delete(s, who, token_id)
    return Response(status_code=204)
