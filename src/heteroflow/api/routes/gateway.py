"""Endpoints, model routes and the routing snapshot (/api/v1/gateway, /api/v1/model-routes)."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Header, Response

from heteroflow.api.deps import DB, Ctx, Who, require_gateway
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.gateway import (
    EndpointRead,
    EndpointUpdate,
    EndpointUpdated,
    ModelRouteCreate,
    ModelRouteRead,
    ModelRouteUpdate,
)
from heteroflow.services import endpoints

router = APIRouter(prefix="/api/v1", tags=["gateway"])


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
