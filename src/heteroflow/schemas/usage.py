"""Wire schemas of token usage (M7, N4): gateway batches in, usage reports out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BaseModel, Field

from heteroflow.schemas.common import ID_PATTERN, MAX_INT32, SafeStr, Strict, to_utc


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Requests and tokens of one (endpoint, tenant, model) since ``recorded_at``."""

    endpoint_id: str
    tenant_id: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    recorded_at: datetime  # when the first request summed in this row was counted

    def to_wire(self) -> dict[str, Any]:
        return {
            "endpoint_id": self.endpoint_id,
            "tenant_id": self.tenant_id,
            "model": self.model,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "recorded_at": self.recorded_at.isoformat(),
        }


MAX_BATCH_RECORDS = 100_000
# tokens in one row (a gateway flushes every 5 s): far above any real figure, and sums
# of many rows stay inside a 64-bit integer
MAX_TOKENS = 10**12


class UsageRecordIn(Strict):
    """One row of a gateway's batch (``gateway.usage.UsageRow.to_wire``)."""

    endpoint_id: SafeStr = Field(min_length=1, max_length=32, pattern=ID_PATTERN)
    tenant_id: SafeStr = Field(min_length=1, max_length=32, pattern=ID_PATTERN)
    model: SafeStr = Field(min_length=1, max_length=256)
    requests: int = Field(ge=0, le=MAX_INT32)
    prompt_tokens: int = Field(ge=0, le=MAX_TOKENS)
    completion_tokens: int = Field(ge=0, le=MAX_TOKENS)
    # an ISO 8601 string with its zone (the one lax field: JSON has no datetime type)
    recorded_at: Annotated[AwareDatetime, AfterValidator(to_utc)] = Field(strict=False)


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
