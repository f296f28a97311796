"""Nodes (/api/v1/nodes) and the agent protocol (/api/v1/agent)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from heteroflow.api.context import ServerContext
from heteroflow.api.deps import DB, AgentNode, Ctx, Who, get_node_id
from heteroflow.core.errors import Unauthorized
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.nodes import (
    Heartbeat,
    HeartbeatReply,
    NodeRead,
    TaskAssignment,
    TaskReport,
    TemplateRead,
)
from heteroflow.services import nodes

router = APIRouter(prefix="/api/v1", tags=["nodes"])


@router.get("/nodes", response_model=list[NodeRead])
def list_nodes(ctx: Ctx, s: DB, who: Who) -> list[NodeRead]:
    # Nodes are shared infrastructure: members see every node their tenant may use (all
    # but those dedicated to other tenants); operators see the whole fleet.
    return nodes.list_nodes(
        s, ctx.clock, ctx.settings.node_offline_after_s,
        None if who.is_operator else who.tenant_id,
    )


@router.get("/nodes/{node_id}/inference-template", response_model=list[TemplateRead])
def inference_template(node_id: IdStr, ctx: Ctx, s: DB, who: Who) -> list[TemplateRead]:
    """The engines this node can run a one-click service with, recommended first ([] if none)."""
    return nodes.inference_templates(s, node_id, None if who.is_operator else who.tenant_id)


# POST /agent/heartbeat is the control plane's hot path: every node, every 5 s
# (bench/control_plane.py, docs/benchmarks.md). The server's dispatcher answers a
# successful one before the framework (``api.heartbeat_fast`` running ``heartbeat_work``);
# this route answers the rest — a refusal, a failure — and is the contract the OpenAPI
# document shows. tests/integration/test_heartbeat_writes.py compares the two.
@router.post("/agent/heartbeat", response_model=HeartbeatReply, tags=["agent"])
def heartbeat(hb: Heartbeat, ctx: Ctx, s: DB, _node: AgentNode) -> HeartbeatReply:
    return nodes.heartbeat(s, ctx.clock, hb)


def heartbeat_work(request: Request, ctx: ServerContext, body: bytes) -> bytes | None:
    """The route's work in the calling thread, for ``api.heartbeat_fast``: the reply's
    JSON, or None when the route must answer (not a JSON heartbeat, a wrong token).

    One trip to the thread pool does it all — the token, the body parsed by pydantic
    from the bytes, the refresh (``services.nodes.refresh``: a read and an UPDATE in
    autocommit; the route's transaction only for a new node or a card gone), the
    reply — where the route takes
    four (its dependencies, the endpoint, the commit), each a wait for the GIL under
    load; a session committed in its own trip also never waits for a thread while it
    holds a connection (a burst of registrations once deadlocked the pool that way).
    """
    headers = request.headers
    if headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/json":
        return None
    try:
        get_node_id(request, ctx, headers.get("authorization"), headers.get("x-heteroflow-node"))
        hb = Heartbeat.model_validate_json(body)
    except (Unauthorized, ValidationError):
        return None
    with ctx.db.autocommit() as conn:  # the common beat: one read, one UPDATE
        reply = nodes.refresh(conn, ctx.clock, hb)
    if reply is None:  # a new node, a card gone: the route's whole transaction
        with ctx.db.session() as s:  # committed before the answer, as with the DB dependency
            reply = nodes.heartbeat(s, ctx.clock, hb)
    return reply.model_dump_json().encode()


@router.post("/agent/tasks/{task_id}/claim", response_model=TaskAssignment, tags=["agent"])
def claim(task_id: IdStr, ctx: Ctx, s: DB, node: AgentNode) -> TaskAssignment:
    return nodes.claim(s, ctx.clock, node, task_id)


@router.post("/agent/tasks/{task_id}/report", tags=["agent"])
def report(task_id: IdStr, rep: TaskReport, ctx: Ctx, s: DB, node: AgentNode) -> dict[str, str]:
    return {"status": nodes.report(s, ctx.clock, node, task_id, rep)}
