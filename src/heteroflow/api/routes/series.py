"""Live time series (issue 33): a service's, a node's and the fleet overview (thin:
``services/series/reads.py`` checks the input and the scope)."""

from __future__ import annotations

from typing import Any

from fastapi import Query

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.services.series import reads

router = api_router(prefix="/api/v1", tags=["series"])
_METRICS = Query(default=None, max_length=1024, description="comma list; empty: all")
_SINCE = Query(default=None, max_length=64, description="90s, 15m, 6h (≤ 24h) or an ISO time")
_STEP = Query(default=None, ge=10, le=3600, description="seconds: a multiple of 10, 10..3600")


@router.get("/task-groups/{group_id}/series")
def service_series(
    group_id: IdStr, s: DB, who: Who, ctx: Ctx,
    metrics: str | None = _METRICS, since: str | None = _SINCE, step: int | None = _STEP,
) -> dict[str, Any]:
    """Requests/s, latency, TTFT, tokens/s, errors, in flight, queue, replicas over time,
    the scaling and rollout events, and each replica's load now (docs/api.md)."""
    settings = ctx.settings
    return reads.service_series(
        s, who, group_id, now=ctx.clock.now(), metrics=metrics, since=since, step=step,
        load_stale_s=settings.gateway_load_stale_s, slots=settings.gateway_backend_concurrency,
    )


@router.get("/nodes/{node_id}/series")
def node_series(
    node_id: IdStr, s: DB, who: Who, ctx: Ctx,
    metrics: str | None = _METRICS, since: str | None = _SINCE, step: int | None = _STEP,
) -> dict[str, Any]:
    """A node's CPU and memory and each card's memory, commitment and temperature."""
    return reads.node_series(
        s, who, node_id, now=ctx.clock.now(), metrics=metrics, since=since, step=step
    )


@router.get("/fleet/overview")
def fleet_overview(s: DB, who: Who) -> dict[str, Any]:
    """Cards in use by tenant, services by state, the last faults."""
    return reads.fleet_overview(s, who)
