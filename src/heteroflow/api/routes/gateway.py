"""Endpoints, model routes and the routing snapshot (/api/v1/gateway, /api/v1/model-routes).

A separate gateway also reports its groups' last request times here (F4,
``POST /gateway/activity``; with its load since issue 14: in flight, tokens/s, the
engines' queue and KV use, per backend) and asks for sleeping services to be woken when a request
names them (F6, ``POST /gateway/wake``), both with the gateway token; each commits
before answering, so a 2xx means stored.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import Depends, Header, Response

from heteroflow.api.deps import DB, Ctx, Who, require_gateway
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.gateway import (
    EndpointRead,
    EndpointUpdate,
    EndpointUpdated,
    ModelRouteCreate,
    ModelRouteRead,
    ModelRouteUpdate,
)
from heteroflow.schemas.routing import (
    ActivityAccepted,
    WakeAnswer,
    WakeOutcomeRead,
    WakeRequest,
)
from heteroflow.schemas.usage import ActivityReport
from heteroflow.services.lifecycle import idle
from heteroflow.services.serving import endpoints
from heteroflow.services.tenancy import usage

router = api_router(prefix="/api/v1", tags=["gateway"])


@router.get("/gateway/endpoints", response_model=list[EndpointRead])
def list_endpoints(s: DB, who: Who) -> list[EndpointRead]:
    return endpoints.list_endpoints(s, who)


@router.put("/gateway/endpoints/{endpoint_id}", response_model=EndpointUpdated)
@router.patch("/gateway/endpoints/{endpoint_id}", response_model=EndpointUpdated)
def update_endpoint(
    endpoint_id: IdStr, req: EndpointUpdate, ctx: Ctx, s: DB, who: Who
) -> EndpointUpdated:
    return endpoints.update_endpoint(s, who, ctx.clock, endpoint_id, req)


@router.delete("/gateway/endpoints/{endpoint_id}", status_code=204)
def delete_endpoint(endpoint_id: IdStr, s: DB, who: Who) -> Response:
    endpoints.delete_endpoint(s, who, endpoint_id)
    return Response(status_code=204)


@router.get("/model-routes", response_model=list[ModelRouteRead])
def list_routes(
    s: DB, who: Who, group_id: IdStr | None = None
) -> list[ModelRouteRead]:
    return endpoints.list_routes(s, who, group_id)


@router.post("/model-routes", response_model=ModelRouteRead, status_code=201)
def create_route(req: ModelRouteCreate, ctx: Ctx, s: DB, who: Who) -> ModelRouteRead:
    return endpoints.create_route(s, who, ctx.clock, req)


@router.delete("/model-routes/{route_id}", status_code=204)
def delete_route(route_id: IdStr, s: DB, who: Who) -> Response:
    endpoints.delete_route(s, who, route_id)
    return Response(status_code=204)


@router.put("/model-routes/{route_id}", response_model=ModelRouteRead)
def update_route(
    route_id: IdStr, req: ModelRouteUpdate, ctx: Ctx, s: DB, who: Who
) -> ModelRouteRead:
    return endpoints.update_route(s, who, ctx.clock, route_id, req)


@router.get(
    "/gateway/snapshot",
    dependencies=[Depends(require_gateway)],
    responses={304: {"description": "unchanged since the version in If-None-Match"}},
)
def snapshot(
    ctx: Ctx, if_none_match: Annotated[str | None, Header(max_length=64)] = None
) -> Any:
    snap = ctx.holder.current
    etag = f'"{snap.version}"'
    if if_none_match == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(
        orjson.dumps(snap.to_wire()), media_type="application/json", headers={"ETag": etag}
    )


@router.post(
    "/gateway/activity",
    response_model=ActivityAccepted,
    dependencies=[Depends(require_gateway)],
)
def report_activity(batch: ActivityReport, ctx: Ctx) -> ActivityAccepted:
    """F4: each group's last routed request, as a gateway saw it (the idle timer's input).
    Times only move forward; unknown groups are ignored. With ``load`` (issue 14), the
    gateway's view of its backends replaces its previous one, stamped with the time it
    arrived here (the autoscaler's figures; what drains wait for)."""
    latest: dict[str, Any] = {}
    for a in batch.activity:
        if a.group_id not in latest or latest[a.group_id] < a.last_request_at:
            latest[a.group_id] = a.last_request_at
    with ctx.db.session() as s:
        updated = idle.record_activity(s, latest)
        if batch.load is not None:
            usage.write_load(s, batch.load.to_load(), ctx.clock.now())
    return ActivityAccepted(updated=updated)


@router.post(
    "/gateway/wake",
    response_model=WakeAnswer,
    dependencies=[Depends(require_gateway)],
)
def wake(req: WakeRequest, ctx: Ctx) -> WakeAnswer:
    """F6: a request named a sleeping model; wake its groups. One result per task, whose
    ``branch`` says whether it is on its way up (the gateway holds the request) or why
    not (node offline, card borrowed, ...: the gateway answers 503 with the message)."""
    with ctx.db.session() as s:
        outcomes = idle.wake_for_request(
            s,
            ctx.clock,
            req.group_ids,
            req.model,
            offline_after_s=ctx.settings.node_offline_after_s,
        )
    return WakeAnswer(results=[WakeOutcomeRead(**o.to_wire()) for o in outcomes])
