"""GET /api/v1/audit: the audit log of management writes, for platform operators."""

from __future__ import annotations

from datetime import datetime

from fastapi import Query

from heteroflow.api.deps import DB, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.audit import AuditPage
from heteroflow.services.identity import audit

router = api_router(prefix="/api/v1", tags=["audit"])

_INT_MAX = 2**31 - 1  # audit_log.id is a 32-bit integer
_ID = r"^[A-Za-z0-9_.-]*$"


@router.get("/audit", response_model=AuditPage)
def read_audit(
    s: DB,
    who: Who,
    user_id: str | None = Query(
        default=None, max_length=32, pattern=_ID, description="'' = unauthenticated calls"
    ),
    tenant_id: str | None = Query(default=None, max_length=32, pattern=_ID),
    method: str | None = Query(
        default=None, max_length=8, description="POST | PUT | PATCH | DELETE"
    ),
    since: datetime | None = Query(
        default=None, description="rows written at or after this time; UTC if no zone"
    ),
    before_id: int | None = Query(
        default=None, ge=0, le=_INT_MAX, description="keyset page: rows with id < before_id"
    ),
    limit: int = Query(default=100, ge=1, le=audit.MAX_LIMIT),
) -> AuditPage:
    return audit.list_records(
        s,
        who,
        user_id=user_id,
        tenant_id=tenant_id,
        method=method,
        since=since,
        before_id=before_id,
        limit=limit,
    )
