"""Registry credentials (/api/v1/registry-credentials, H7): operators and tenant admins.

The password is write-only: every answer is ``RegistryCredentialRead`` (host, username,
who, when). The audit log records these writes without their bodies, as every write.
"""

from __future__ import annotations

from fastapi import Response

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.registry_credentials import (
    RegistryCredentialCreate,
    RegistryCredentialRead,
    RegistryCredentialUpdate,
)
from heteroflow.services.tenancy import registry_credentials as credentials

router = api_router(prefix="/api/v1/registry-credentials", tags=["registry credentials"])


@router.post("", response_model=RegistryCredentialRead, status_code=201)
def create_credential(
    req: RegistryCredentialCreate, ctx: Ctx, s: DB, who: Who
) -> RegistryCredentialRead:
    return credentials.create(s, ctx.clock, who, ctx.sealer, req)


@router.get("", response_model=list[RegistryCredentialRead])
def list_credentials(s: DB, who: Who) -> list[RegistryCredentialRead]:
    return credentials.list_credentials(s, who)


@router.get("/{credential_id}", response_model=RegistryCredentialRead)
def get_credential(credential_id: IdStr, s: DB, who: Who) -> RegistryCredentialRead:
    return credentials.get(s, who, credential_id)


@router.patch("/{credential_id}", response_model=RegistryCredentialRead)
def update_credential(
    credential_id: IdStr, req: RegistryCredentialUpdate, ctx: Ctx, s: DB, who: Who
) -> RegistryCredentialRead:
    return credentials.update(s, ctx.clock, who, ctx.sealer, credential_id, req)


@router.delete("/{credential_id}", status_code=204)
def delete_credential(credential_id: IdStr, s: DB, who: Who) -> Response:
    credentials.delete(s, who, credential_id)
    return Response(status_code=204)
