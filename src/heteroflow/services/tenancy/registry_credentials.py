"""Registry credentials (H7): the logins nodes pull private images with.

**Who.** One credential per (tenant, registry host); tenant "" is the platform's own, used
for a tenant that has none for that registry. An operator manages every one; a tenant
admin (role ``tenant_admin``) only their own tenant's; a member none (403). Another
tenant's credential, or the platform's, answers a tenant admin 404, as every object of
another tenant does (services/identity/access.py).

**Sealed at rest.** The password is stored as AES-256-GCM ciphertext under a key derived
(HKDF-SHA256, its own ``info``) from the platform's ``engine_key_secret`` — a secret every
server instance already shares through ``platform_settings`` and that never rotates
(rotating the JWT secret must not make every credential unreadable). The row's id is the
associated data, so a sealed value moved to another row does not open. Nothing returns the
password: the read model has no such field, and the audit log never records bodies. The
plain password exists only in a create or update request and in the claim reply to the
agent of the node that runs the task (``auth_for``); both register it with the log
redaction (``logs.register_secrets``), so it never reaches a log line.

**Which credential a pull gets** (``auth_for``): the image's registry host
(``core.images.registry_host``), the task's tenant's own credential first, else the
platform's, else none (the node's own Docker configuration applies).
"""

from __future__ import annotations

import base64
import logging
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict
from heteroflow.core.ids import new_id
from heteroflow.core.images import registry_host
from heteroflow.db.tables import RegistryCredential, Task
from heteroflow.logs import register_secrets
from heteroflow.schemas.registry_credentials import (
    RegistryAuth,
    RegistryCredentialCreate,
    RegistryCredentialRead,
    RegistryCredentialUpdate,
)
from heteroflow.services.identity.auth import Principal
from heteroflow.services.tenancy.tenant_secrets import (
    PLATFORM,
    owner_tenant,
    refuse_members,
    visible,
)
from heteroflow.services.unique import taken_as

log = logging.getLogger(__name__)

WHAT = "registry credentials"
_SEAL_INFO = b"heteroflow/registry-credentials/v1"
_SEAL_PREFIX = "v1."


class Sealer:
    """Seals and opens passwords with a key derived from a platform secret."""

    def __init__(self, platform_secret: str) -> None:
        key = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO
        ).derive(platform_secret.encode())
        self._aead = AESGCM(key)

    def seal(self, plain: str, row_id: str) -> str:
        nonce = secrets.token_bytes(12)
        sealed = self._aead.encrypt(nonce, plain.encode(), row_id.encode())
        return _SEAL_PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, sealed: str, row_id: str) -> str:
        """The password; ValueError when it was not sealed for this row by this key."""
        if not sealed.startswith(_SEAL_PREFIX):
            raise ValueError("not a sealed value")
        raw = base64.urlsafe_b64decode(sealed[len(_SEAL_PREFIX):])
        try:
            return self._aead.decrypt(raw[:12], raw[12:], row_id.encode()).decode()
        except InvalidTag as exc:
            raise ValueError("sealed with another key or for another row") from exc


def _visible(s: Session, who: Principal, credential_id: str) -> RegistryCredential:
    return visible(s, who, RegistryCredential, credential_id, "registry credential", WHAT)


def _owner_tenant(s: Session, who: Principal, asked: str | None) -> str:
    return owner_tenant(s, who, asked, WHAT)


def create(
    s: Session, clock: Clock, who: Principal, sealer: Sealer, req: RegistryCredentialCreate
) -> RegistryCredentialRead:
    refuse_members(who, WHAT)
    password = req.password.get_secret_value()
    register_secrets(password)
    tenant_id = _owner_tenant(s, who, req.tenant_id)
    whose = "the platform" if tenant_id == PLATFORM else f"tenant {tenant_id}"
    clash = Conflict(
        f"{whose} already has a credential for {req.registry_host}: update it "
        "(PATCH /api/v1/registry-credentials/{id}) or delete it first",
        field="registry_host",
    )
    exists = s.scalar(
        select(RegistryCredential.id).where(
            RegistryCredential.tenant_id == tenant_id,
            RegistryCredential.registry_host == req.registry_host,
        )
    )
    if exists is not None:
        raise clash
    now = clock.now()
    row_id = new_id("rc")
    row = RegistryCredential(
        id=row_id,
        tenant_id=tenant_id,
        registry_host=req.registry_host,
        username=req.username,
        password_sealed=sealer.seal(password, row_id),
        created_by=who.user_id,
        created_at=now,
        updated_at=now,
    )
    with taken_as(s, clash):
        s.add(row)
    return RegistryCredentialRead.model_validate(row, from_attributes=True)


def list_credentials(s: Session, who: Principal) -> list[RegistryCredentialRead]:
    refuse_members(who, WHAT)
    q = select(RegistryCredential).order_by(
        RegistryCredential.tenant_id, RegistryCredential.registry_host
    )
    if not who.is_operator:
        q = q.where(RegistryCredential.tenant_id == who.tenant_id)
    return [
        RegistryCredentialRead.model_validate(row, from_attributes=True) for row in s.scalars(q)
    ]


def get(s: Session, who: Principal, credential_id: str) -> RegistryCredentialRead:
    return RegistryCredentialRead.model_validate(
        _visible(s, who, credential_id), from_attributes=True
    )


def update(
    s: Session,
    clock: Clock,
    who: Principal,
    sealer: Sealer,
    credential_id: str,
    req: RegistryCredentialUpdate,
) -> RegistryCredentialRead:
    row = _visible(s, who, credential_id)
    if req.username is not None:
        row.username = req.username
    if req.password is not None:
        password = req.password.get_secret_value()
        register_secrets(password)
        row.password_sealed = sealer.seal(password, row.id)
    row.updated_at = clock.now()
    s.flush()
    return RegistryCredentialRead.model_validate(row, from_attributes=True)


def delete(s: Session, who: Principal, credential_id: str) -> None:
    s.delete(_visible(s, who, credential_id))


def auth_for_task(
    s: Session, sealer: Sealer, task_id: str, image: str
) -> RegistryAuth | None:
    """``auth_for`` the task's tenant (the claim of a task)."""
    tenant_id = s.scalar(select(Task.tenant_id).where(Task.id == task_id))
    return auth_for(s, sealer, tenant_id or "", image) if tenant_id is not None else None


def auth_for(s: Session, sealer: Sealer, tenant_id: str, image: str) -> RegistryAuth | None:
    """The login a pull of ``image`` for ``tenant_id`` uses: the tenant's own for the
    image's registry, else the platform's, else None. Its password is registered with
    the log redaction before it is returned."""
    if not image:
        return None
    host = registry_host(image)
    rows = list(
        s.scalars(
            select(RegistryCredential).where(
                RegistryCredential.registry_host == host,
                or_(
                    RegistryCredential.tenant_id == tenant_id,
                    RegistryCredential.tenant_id == PLATFORM,
                ),
            )
        )
    )
    if not rows:
        return None
    row = min(rows, key=lambda r: r.tenant_id == PLATFORM)  # the tenant's own first
    try:
        password = sealer.open(row.password_sealed, row.id)
    except ValueError:
        # sealed under another platform secret (a database restored beside new secrets):
        # the claim goes on without it — the pull then fails "unauthorised", naming what
        # to set — rather than failing the claim itself
        log.warning(
            "registry credential %s (%s, tenant %r) cannot be opened with this platform's "
            "secret: set its password again (PATCH /api/v1/registry-credentials/%s)",
            row.id, row.registry_host, row.tenant_id, row.id,
        )
        return None
    register_secrets(password)
    return RegistryAuth(username=row.username, password=password)
