"""Wire schemas of token usage (M7, N4): gateway batches in, usage reports out.

A gateway's activity report also carries its load (I1, I2, J1): per backend it routes
to, the requests in flight on it through this gateway, the tokens/s it answered, the
engine's own queue and KV-cache use when scraped, and whether the gateway's routing
snapshot already says the backend drains (``GatewayLoad``). The server keeps the latest
report of each gateway (``services.usage.write_load``); the autoscaler and the drains
of a scale-in or a rolling update read them (``services.usage.read_load``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, AwareDatetime, BaseModel, Field

from heteroflow.schemas.common import ID_PATTERN, MAX_INT32, IdStr, SafeStr, Strict, to_utc
from heteroflow.schemas.routing import MAX_ACTIVITY_GROUPS, ActivityBatch, ActivityIn


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
    """Token sums, and GPU time (N4) when the report was asked for it (``gpu=true``).

    GPU time is card-seconds by commitment (``core.metering``) and task-seconds, the
    ``running`` and ``sleeping`` states apart; it has no endpoint, so it is null in rows
    grouped by endpoint and everywhere when filtered by one. The route leaves unset
    fields out of the answer, so a report not asked for GPU time keeps its old shape.
    """

    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    gpu_running_card_seconds: float | None = None
    gpu_sleeping_card_seconds: float | None = None
    running_task_seconds: float | None = None
    sleeping_task_seconds: float | None = None


# the GPU fields, in the order of the answer and of the CSV columns
GPU_FIELDS = (
    "gpu_running_card_seconds",
    "gpu_sleeping_card_seconds",
    "running_task_seconds",
    "sleeping_task_seconds",
)


class UsageRowRead(UsageSums):
    """One group of the report; the four first fields, when not grouped by, are null;
    ``service_id``, ``hour`` and ``day`` are there only when grouped by."""

    tenant_id: str | None = None
    member_id: str | None = None  # tokens: who created the key; GPU time: the task's owner
    endpoint_id: str | None = None
    model: str | None = None
    service_id: str | None = None  # the task group (tokens: the key's endpoint's group)
    hour: datetime | None = None  # the UTC hour's start
    day: date | None = None  # the UTC day


class UsageReport(BaseModel):
    start: datetime | None  # null: from the first record
    end: datetime | None  # null: up to now
    group_by: list[str]
    rows: list[UsageRowRead]
    total: UsageSums


# ---- the gateway's load (issue 14: I1 autoscaler, I2 scale-in drains, J1 drains) ----

MAX_LOAD_BACKENDS = 100_000
ErrorKind = Literal["4xx", "429", "5xx", "client_left"]  # core.series.error_kind
# a gateway id: "gw-" + 12 hex digits (a new one at every gateway start)
GATEWAY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,48}$"


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """One backend (a running task) as one gateway sees it."""

    task_id: str
    group_id: str
    draining: bool  # the gateway's snapshot marks it draining: it gets no new request
    in_flight: int  # requests through this gateway on it now
    tokens_per_s: float  # tokens (prompt + completion) it answered, over the last 30 s
    waiting: float | None = None  # the engine's queue (its /metrics), when scraped
    kv_use: float | None = None  # the engine's KV-cache use 0..1, when it exports it
    # issue 33 (the live series): answers through this gateway since it started, its
    # errors by kind (core.series.error_kind), [p50, p95] of latency and of time to
    # first bytes over the last 30 s (ms), the engine's prefix-cache [hits, queries]
    answered: int | None = None
    errors: dict[str, int] | None = None
    latency_ms: list[float] | None = None
    ttft_ms: list[float] | None = None
    prefix: tuple[float, float] | None = None
    # the gateway's capacity estimate: milliseconds per completion token (M15's decaying
    # seconds per token, gateway/routing/capacity.py); None: no recent answer
    ms_per_token: float | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "waiting": self.waiting,
            "kv_use": self.kv_use,
        }
        for name in ("answered", "errors", "latency_ms", "ttft_ms", "prefix", "ms_per_token"):
            v = getattr(self, name)
            if v is not None:
                out[name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True, slots=True)
class GatewayLoad:
    """A gateway's load report: every backend of its current routing snapshot."""

    gateway_id: str
    backends: tuple[BackendLoad, ...] = ()
    # issue 33: per service, the requests refused before a backend was chosen (no
    # healthy backend, a hold that timed out...) by error kind, since the gateway started
    refused: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gateway_id": self.gateway_id, "backends": [b.to_wire() for b in self.backends]
        }
        if self.refused:
            out["refused"] = {g: dict(e) for g, e in self.refused.items()}
        return out


class BackendLoadIn(Strict):
    task_id: IdStr
    group_id: IdStr
    draining: bool = False
    in_flight: int = Field(ge=0, le=MAX_INT32)
    tokens_per_s: float = Field(default=0.0, ge=0.0, le=1e12, strict=False)
    waiting: float | None = Field(default=None, ge=0.0, le=1e9, strict=False)
    kv_use: float | None = Field(default=None, ge=0.0, le=1.0, strict=False)
    # issue 33 (the live series); older gateways send none of them
    answered: int | None = Field(default=None, ge=0, le=2**62)
    errors: dict[ErrorKind, Annotated[int, Field(ge=0, le=2**62)]] | None = Field(
        default=None, max_length=len(get_args(ErrorKind))
    )
    latency_ms: list[Annotated[float, Field(ge=0.0, le=1e9, strict=False)]] | None = Field(
        default=None, min_length=2, max_length=2
    )
    ttft_ms: list[Annotated[float, Field(ge=0.0, le=1e9, strict=False)]] | None = Field(
        default=None, min_length=2, max_length=2
    )
    prefix: list[Annotated[float, Field(ge=0.0, le=1e18, strict=False)]] | None = Field(
        default=None, min_length=2, max_length=2
    )
    ms_per_token: float | None = Field(default=None, ge=0.0, le=1e9, strict=False)

    def to_load(self) -> BackendLoad:
        return BackendLoad(
            task_id=self.task_id,
            group_id=self.group_id,
            draining=self.draining,
            in_flight=self.in_flight,
            tokens_per_s=self.tokens_per_s,
            waiting=self.waiting,
            kv_use=self.kv_use,
            answered=self.answered,
            errors=None if self.errors is None else {str(k): v for k, v in self.errors.items()},
            latency_ms=self.latency_ms,
            ttft_ms=self.ttft_ms,
            prefix=(self.prefix[0], self.prefix[1]) if self.prefix is not None else None,
            ms_per_token=self.ms_per_token,
        )


class GatewayLoadIn(Strict):
    gateway_id: SafeStr = Field(max_length=48, pattern=GATEWAY_ID_PATTERN)
    backends: list[BackendLoadIn] = Field(default_factory=list, max_length=MAX_LOAD_BACKENDS)
    refused: dict[
        IdStr,
        Annotated[
            dict[ErrorKind, Annotated[int, Field(ge=0, le=2**62)]],
            Field(max_length=len(get_args(ErrorKind))),
        ],
    ] = Field(
        default_factory=dict, max_length=MAX_LOAD_BACKENDS
    )

    def to_load(self) -> GatewayLoad:
        return GatewayLoad(
            self.gateway_id, tuple(b.to_load() for b in self.backends),
            {g: {str(k): v for k, v in e.items()} for g, e in self.refused.items()},
        )


class ActivityReport(ActivityBatch):
    """``POST /api/v1/gateway/activity``: the groups' last request times (F4) and, from
    gateways that send it, their load (issue 14)."""

    activity: list[ActivityIn] = Field(default_factory=list, max_length=MAX_ACTIVITY_GROUPS)
    load: GatewayLoadIn | None = None


def activity_report_to_wire(
    activity: dict[str, datetime], load: GatewayLoad | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "activity": [
            {"group_id": g, "last_request_at": t.isoformat()} for g, t in activity.items()
        ]
    }
    if load is not None:
        out["load"] = load.to_wire()
    return out
