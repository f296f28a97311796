"""The nodes' model caches (issue 29, H9): operators list them (/api/v1/models/cache), ask
one node to pull or evict a model (/api/v1/nodes/{node_id}/models/...) and follow the
request (/api/v1/model-requests/{id}); agents claim and report them
(/api/v1/agent/model-requests)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

from heteroflow.api.deps import DB, AgentNode, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.model_requests import (
    AgentModelRequest,
    CachedModelRead,
    ModelEvict,
    ModelPull,
    ModelRequestRead,
    ModelRequestReport,
    NodeRef,
)
from heteroflow.services.agents import model_requests

router = api_router(prefix="/api/v1", tags=["models"])

# at most this many ids in one poll's ``held`` (the agent's requests under way)
MAX_HELD = 64


@router.get("/models/cache", response_model=list[CachedModelRead])
def list_cached(
    s: DB, who: Who, node: Annotated[NodeRef | None, Query()] = None
) -> list[CachedModelRead]:
    """Every node's cached models (or ``node``'s, by id or name), as their heartbeats say."""
    return model_requests.cached_models(s, who, node)


# ``node_id``: the node's id or its name (both unique)
@router.post("/nodes/{node_id}/models/pull", response_model=ModelRequestRead, status_code=202)
def pull(node_id: NodeRef, body: ModelPull, ctx: Ctx, s: DB, who: Who) -> ModelRequestRead:
    """The node's agent fetches ``source`` into its cache; the open request for the same
    source on the node, if there is one, answers instead of a second."""
    return model_requests.request_pull(
        s, who, ctx.clock, node_id, body, ctx.settings.node_offline_after_s
    )


@router.post("/nodes/{node_id}/models/evict", response_model=ModelRequestRead, status_code=202)
def evict(node_id: NodeRef, body: ModelEvict, ctx: Ctx, s: DB, who: Who) -> ModelRequestRead:
    """The node's agent removes ``key`` from its cache (refused while a task uses it)."""
    return model_requests.request_evict(
        s, who, ctx.clock, node_id, body, ctx.settings.node_offline_after_s
    )


@router.get("/model-requests/{request_id}", response_model=ModelRequestRead)
def get_request(request_id: IdStr, ctx: Ctx, s: DB, who: Who) -> ModelRequestRead:
    return model_requests.get_request(
        s, who, ctx.clock, request_id, ctx.settings.node_offline_after_s
    )


@router.get("/agent/model-requests", response_model=list[AgentModelRequest], tags=["agent"])
def claim_requests(
    ctx: Ctx,
    s: DB,
    node: AgentNode,
    held: Annotated[list[IdStr], Query(max_length=MAX_HELD)] = [],  # noqa: B006 - FastAPI copies it
) -> list[AgentModelRequest]:
    """This node's pending requests, claimed by this call; its running ones not in
    ``held`` (the ones its agent still works on) fail: they were lost."""
    return model_requests.claim(s, ctx.clock, node, held, ctx.settings.node_offline_after_s)


@router.post("/agent/model-requests/{request_id}", tags=["agent"])
def report(
    request_id: IdStr, rep: ModelRequestReport, ctx: Ctx, s: DB, node: AgentNode
) -> dict[str, str]:
    return {"status": model_requests.report(s, ctx.clock, node, request_id, rep)}
