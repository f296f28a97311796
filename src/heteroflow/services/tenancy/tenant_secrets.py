"""Who manages a secret kept per tenant — registry credentials (H7) and hub tokens (H9):
one rule for both.

An operator manages every tenant's and the platform's own (tenant ``PLATFORM``, ""); a
tenant admin only their own tenant's; a member none (403). Another tenant's secret, or
the platform's, answers a tenant admin 404, as every object of another tenant does.
``what`` names the kind in the messages ("hub tokens", "registry credentials").
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy.orm import Session

from heteroflow.core.errors import Forbidden, NotFound
from heteroflow.db.tables import Tenant
from heteroflow.services.identity.auth import Principal

PLATFORM = ""  # the tenant_id of the platform's own secrets

Row = TypeVar("Row")


def may_manage(who: Principal, tenant_id: str) -> bool:
    if who.is_operator:
        return True
    return who.is_tenant_admin and tenant_id == who.tenant_id and tenant_id != PLATFORM


def refuse_members(who: Principal, what: str) -> None:
    if not (who.is_operator or who.is_tenant_admin):
        raise Forbidden(f"only an operator or a tenant admin manages {what}")


def visible(s: Session, who: Principal, table: type[Row], row_id: str, one: str,
            what: str) -> Row:
    """The row ``row_id`` of ``table`` if ``who`` may manage it, else 404 (``one``: how
    a message names one, e.g. "hub token")."""
    refuse_members(who, what)
    row: Any = s.get(table, row_id)
    if row is None or not may_manage(who, row.tenant_id):
        raise NotFound(f"{one} {row_id!r} not found")
    return row  # type: ignore[no-any-return]


def owner_tenant(s: Session, who: Principal, asked: str | None, what: str) -> str:
    """Whose secret a create writes: an operator's choice (the platform's by default), a
    tenant admin's own tenant."""
    if who.is_operator:
        tenant_id = asked or PLATFORM
        if tenant_id != PLATFORM and s.get(Tenant, tenant_id) is None:
            raise NotFound(f"tenant {tenant_id!r} not found", field="tenant_id")
        return tenant_id
    tenant_id = who.tenant_id if asked is None else asked
    if tenant_id != who.tenant_id:
        raise Forbidden(
            f"a tenant admin sets only their own tenant's {what} (the platform's are "
            "an operator's)",
            field="tenant_id",
        )
    return tenant_id
