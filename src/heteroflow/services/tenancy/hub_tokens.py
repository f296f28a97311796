"""Hub tokens (issue 29 item 1, H9): the credentials a tenant's gated or private models
are resolved and fetched with, from Hugging Face or ModelScope (or the operator's mirror).

**Who.** One token per (tenant, hub); tenant "" is the platform's own, used for a tenant
that has none for that hub. An operator manages every one; a tenant admin only their own
tenant's; a member none (403); another tenant's, or the platform's, answers a tenant admin
404 — the rule of registry credentials (``registry_credentials``), which this follows.

**Sealed at rest** by the same ``Sealer`` as registry passwords (one key, derived from the
platform's never-rotated ``engine_key_secret``): the row id is the associated data, and a
hub token's id (``ht-``) is never a registry credential's (``rc-``), so a value moved
between the tables, or between rows, does not open — the separation a second key would
give, without a second key for every server to build and hold. ``token_hint`` (the last 4
characters, "hf_…abcd") is written with it, so a read never opens a token. The plain token
exists only in a create or update request, and in the claim reply to the agent of the node
that runs the task; each registers it with the log redaction (``logs.register_secrets``).

**Which token** (``hub_token_for``, the one rule): the tenant's own for the hub, else the
platform's, else None — the caller then uses its setting (``hub_token`` of the server at
create and dry run, of the node at a fetch). Create and dry run read it in a short session
of their own (``reader``) before the hub is asked, so no network wait holds a
transaction; the claim carries the task tenant's (``token_for_task``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, ValidationFailed
from heteroflow.core.ids import new_id
from heteroflow.core.model_sources import is_source_url, parse_model_source
from heteroflow.db.engine import Database
from heteroflow.db.tables import HubToken, Task
from heteroflow.logs import register_secrets
from heteroflow.schemas.hub_tokens import HUBS, HubTokenCreate, HubTokenRead, HubTokenUpdate
from heteroflow.services.identity.auth import Principal
from heteroflow.services.tenancy.registry_credentials import Sealer
from heteroflow.services.tenancy.tenant_secrets import (
    PLATFORM,
    owner_tenant,
    refuse_members,
    visible,
)
from heteroflow.services.unique import taken_as

log = logging.getLogger(__name__)

WHAT = "hub tokens"
#: A token shorter than this shows no character of itself (4 of 8 would be half of it).
HINT_MIN_CHARS = 16

#: ``hub kind -> token or None`` for one tenant (see ``reader``).
TokenOf = Callable[[str], str | None]


def hint(token: str) -> str:
    """What a read shows of ``token``: its last 4 characters, after Hugging Face's own
    ``hf_`` prefix when it has it ("hf_…abcd"), so an admin can tell which one is set."""
    if len(token) < HINT_MIN_CHARS:
        return "…"
    return ("hf_" if token.startswith("hf_") else "") + "…" + token[-4:]


def _visible(s: Session, who: Principal, token_id: str) -> HubToken:
    return visible(s, who, HubToken, token_id, "hub token", WHAT)


def _owner_tenant(s: Session, who: Principal, asked: str | None) -> str:
    return owner_tenant(s, who, asked, WHAT)


def _read(row: HubToken) -> HubTokenRead:
    return HubTokenRead.model_validate(row, from_attributes=True)


def create(
    s: Session, clock: Clock, who: Principal, sealer: Sealer, req: HubTokenCreate
) -> HubTokenRead:
    refuse_members(who, WHAT)
    token = req.token.get_secret_value()
    register_secrets(token)
    tenant_id = _owner_tenant(s, who, req.tenant_id)
    whose = "the platform" if tenant_id == PLATFORM else f"tenant {tenant_id}"
    clash = Conflict(
        f"{whose} already has a {req.hub} token: update it "
        "(PATCH /api/v1/hub-tokens/{id}) or delete it first",
        field="hub",
    )
    exists = s.scalar(
        select(HubToken.id).where(HubToken.tenant_id == tenant_id, HubToken.hub == req.hub)
    )
    if exists is not None:
        raise clash
    now = clock.now()
    row_id = new_id("ht")
    row = HubToken(
        id=row_id, tenant_id=tenant_id, hub=req.hub,
        token_sealed=sealer.seal(token, row_id), token_hint=hint(token),
        created_by=who.user_id, created_at=now, updated_at=now,
    )
    with taken_as(s, clash):
        s.add(row)
    return _read(row)


def list_tokens(s: Session, who: Principal) -> list[HubTokenRead]:
    refuse_members(who, WHAT)
    q = select(HubToken).order_by(HubToken.tenant_id, HubToken.hub)
    if not who.is_operator:
        q = q.where(HubToken.tenant_id == who.tenant_id)
    return [_read(row) for row in s.scalars(q)]


def get(s: Session, who: Principal, token_id: str) -> HubTokenRead:
    return _read(_visible(s, who, token_id))


def update(
    s: Session, clock: Clock, who: Principal, sealer: Sealer, token_id: str,
    req: HubTokenUpdate,
) -> HubTokenRead:
    row = _visible(s, who, token_id)
    token = req.token.get_secret_value()
    register_secrets(token)
    row.token_sealed = sealer.seal(token, row.id)
    row.token_hint = hint(token)
    row.updated_at = clock.now()
    s.flush()
    return _read(row)


def delete(s: Session, who: Principal, token_id: str) -> None:
    s.delete(_visible(s, who, token_id))


def hub_token_for(s: Session, sealer: Sealer, tenant_id: str, hub: str) -> str | None:
    """The token ``tenant_id`` reaches ``hub`` (``hf`` | ``modelscope``) with: the
    tenant's own, else the platform's, else None (the caller's setting applies). It is
    registered with the log redaction before it is returned."""
    if hub not in HUBS:
        return None  # a web server or a fleet copy: no hub token ever goes there
    rows = list(
        s.scalars(
            select(HubToken).where(
                HubToken.hub == hub,
                or_(HubToken.tenant_id == tenant_id, HubToken.tenant_id == PLATFORM),
            )
        )
    )
    if not rows:
        return None
    row = min(rows, key=lambda r: r.tenant_id == PLATFORM)  # the tenant's own first
    try:
        token = sealer.open(row.token_sealed, row.id)
    except ValueError:
        # sealed under another platform secret (a database restored beside new secrets):
        # the hub then answers "unauthorized" for a private model, and this line says
        # what to set — rather than a claim or a create failing on it
        log.warning(
            "hub token %s (%s, tenant %r) cannot be opened with this platform's secret: "
            "set it again (PATCH /api/v1/hub-tokens/%s)",
            row.id, row.hub, row.tenant_id, row.id,
        )
        return None
    register_secrets(token)
    return token


def reader(db: Database, sealer: Sealer, tenant_id: str) -> TokenOf:
    """``hub_token_for`` of ``tenant_id``, each call in a short session of its own: what
    create and dry run hand the resolver, so the hub's answer is awaited holding none."""

    def token_of(hub: str) -> str | None:
        with db.session() as s:
            return hub_token_for(s, sealer, tenant_id, hub)

    return token_of


def token_for_task(s: Session, sealer: Sealer, task_id: str, model_path: str) -> str | None:
    """``hub_token_for`` the task's tenant and its model's hub (the claim of a task);
    None when its model is not a hub source."""
    if not is_source_url(model_path):
        return None
    try:
        hub = parse_model_source(model_path).kind.value
    except ValidationFailed:
        return None  # refused at create; the agent says why when it launches
    if hub not in HUBS:
        return None
    tenant_id = s.scalar(select(Task.tenant_id).where(Task.id == task_id))
    return hub_token_for(s, sealer, tenant_id, hub) if tenant_id is not None else None
