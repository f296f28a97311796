"""The audit log (issue 10, item 9): who made which management write, when, from where.

Rows are written by ``api/audit_middleware.py`` (after the answer is sent) and read by
platform operators (``GET /api/v1/audit``). A row never holds a request body: bodies
carry passwords and API keys. Old rows are deleted after ``audit_retention_days``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from heteroflow.core.errors import Forbidden, ValidationFailed
from heteroflow.db.tables import AuditRecord
from heteroflow.schemas.audit import AuditPage, AuditRead
from heteroflow.services.identity.auth import Principal

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_LIMIT = 1000
# column widths of audit_log (migration 0007)
_WIDTHS = {
    "user_id": 32,
    "username": 128,
    "tenant_id": 32,
    "role": 16,
    "method": 8,
    "path": 512,
    "remote_addr": 64,
    "detail": 1024,
}


@dataclass(frozen=True, slots=True)
class AuditEntry:
    created_at: datetime
    method: str
    path: str
    status: int
    remote_addr: str = ""
    user_id: str = ""
    username: str = ""
    tenant_id: str = ""
    role: str = ""
    detail: str = ""


def clean(value: str, width: int) -> str:
    """Printable text of at most ``width`` characters (PostgreSQL refuses NUL in text;
    control characters in a logged path could forge lines in an exported log)."""
    return "".join(c if c.isprintable() else "\ufffd" for c in value[:width])


def record(s: Session, entry: AuditEntry) -> None:
    """Add one row (the caller's unit of work commits it)."""
    w = _WIDTHS
    s.add(
        AuditRecord(
            created_at=entry.created_at,
            user_id=clean(entry.user_id, w["user_id"]),
            username=clean(entry.username, w["username"]),
            tenant_id=clean(entry.tenant_id, w["tenant_id"]),
            role=clean(entry.role, w["role"]),
            method=clean(entry.method, w["method"]),
            path=clean(entry.path, w["path"]),
            status=entry.status,
            remote_addr=clean(entry.remote_addr, w["remote_addr"]),
            detail=clean(entry.detail, w["detail"]),
        )
    )


def prune(s: Session, now: datetime, retention_days: int) -> int:
    """Delete rows older than ``retention_days`` (0 keeps everything); how many went."""
    if retention_days <= 0:
        return 0
    cutoff = now - timedelta(days=retention_days)
    res = s.execute(delete(AuditRecord).where(AuditRecord.created_at < cutoff))
    return int(getattr(res, "rowcount", 0) or 0)


def _utc(t: datetime, field: str) -> datetime:
    try:
        return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    except (OverflowError, ValueError):  # e.g. 9999-12-31T23:00-05:00 is past year 9999
        raise ValidationFailed(f"{field}: out of range", field=field) from None


def list_records(
    s: Session,
    who: Principal,
    *,
    user_id: str | None = None,
    tenant_id: str | None = None,
    method: str | None = None,
    since: datetime | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> AuditPage:
    """Newest first (by id, the order rows were written); keyset pages via ``before_id``."""
    if not who.is_operator:
        raise Forbidden("only a platform operator reads the audit log")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(f"limit: between 1 and {MAX_LIMIT}", field="limit")
    q = select(AuditRecord)
    if user_id is not None:
        q = q.where(AuditRecord.user_id == user_id)
    if tenant_id is not None:
        q = q.where(AuditRecord.tenant_id == tenant_id)
    if method is not None:
        m = method.upper()
        if m not in WRITE_METHODS:
            raise ValidationFailed(
                "method: one of " + ", ".join(sorted(WRITE_METHODS)), field="method"
            )
        q = q.where(AuditRecord.method == m)
    if since is not None:
        q = q.where(AuditRecord.created_at >= _utc(since, "since"))
    if before_id is not None:
        q = q.where(AuditRecord.id < before_id)
    rows = list(s.scalars(q.order_by(AuditRecord.id.desc()).limit(limit)))
    records = [AuditRead.model_validate(r, from_attributes=True) for r in rows]
    next_before = records[-1].id if len(records) == limit else None
    return AuditPage(records=records, next_before_id=next_before)
