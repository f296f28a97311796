"""Wire schemas of token usage (M7, N4): gateway batches in, usage reports out."""

from __future__ import annotations

from datetime import datetime

from pydantic import AwareDatetime, BaseModel, Field

from heteroflow.schemas.common import Strict

MAX_BATCH_RECORDS = 100_000


class UsageRecordIn(Strict):
    """One row of a gateway's batch (``gateway.usage.UsageRow.to_wire``)."""

    endpoint_id: str = Field(min_length=1, max_length=32)
    tenant_id: str = Field(min_length=1, max_length=32)
    model: str = Field(min_length=1, max_length=256)
    requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    recorded_at: AwareDatetime


class UsageBatch(Strict):
    records: list[UsageRecordIn] = Field(max_length=MAX_BATCH_RECORDS)


class UsageAccepted(BaseModel):
    accepted: int


class UsageSums(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageRowRead(UsageSums):
    """One group of the report; the fields not grouped by are null."""

    tenant_id: str | None = None
    member_id: str | None = None  # the member who created the endpoint's key
    endpoint_id: str | None = None
    model: str | None = None


class UsageReport(BaseModel):
    start: datetime | None  # null: from the first record
    end: datetime | None  # null: up to now
    group_by: list[str]
    rows: list[UsageRowRead]
    total: UsageSums
