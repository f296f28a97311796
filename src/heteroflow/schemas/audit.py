"""Wire schemas of the audit log (issue 10, item 9): one row per management write."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class AuditRead(BaseModel):
    id: int
    created_at: datetime
    user_id: str  # "" when nobody was authenticated (a login attempt, a refused token)
    username: str
    tenant_id: str
    role: str  # operator | member | agent | gateway | ""
    method: str
    path: str
    status: int  # the answer's status code; 0 when no answer was sent
    remote_addr: str
    detail: str  # ids from the path and names of query parameters; never the body


class AuditPage(BaseModel):
    records: list[AuditRead]  # newest first (highest id first)
    # pass as ?before_id= for the next (older) page; null when this page is the last
    next_before_id: int | None
