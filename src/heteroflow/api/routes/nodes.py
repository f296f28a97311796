"""Nodes (/api/v1/nodes) and the agent protocol (/api/v1/agent)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import Request
from pydantic import ValidationError

from heteroflow.api.context import ServerContext
from heteroflow.api.deps import DB, AgentNode, Ctx, Who, get_node_id
from heteroflow.api.heartbeat_fast import Beat
from heteroflow.api.unit_of_work import api_router
from heteroflow.core.errors import Unauthorized
from heteroflow.logs import REQUEST_ID
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.nodes import (
    Heartbeat,
    HeartbeatReply,
    NodeRead,
    TaskAssignment,
    TaskReport,
    TemplateRead,
)
from heteroflow.schemas.prepull import PrepullAsk, PrepullReport
from heteroflow.services.agents import nodes
from heteroflow.services.lifecycle.rollout import prepull
from heteroflow.services.tenancy import hub_tokens, registry_credentials

log = logging.getLogger(__name__)

router = api_router(prefix="/api/v1", tags=["nodes"])


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
    return _keyed(ctx, nodes.heartbeat(s, ctx.clock, hb))


def _keyed(ctx: ServerContext, reply: HeartbeatReply) -> HeartbeatReply:
    """Each task with its engine's key (C14), which only its own node's agent gets."""
    for t in reply.tasks:
        t.engine_key = ctx.engine_key(t.id)
    return reply


def heartbeat_work(ctx: ServerContext, beats: Sequence[Beat]) -> list[bytes | None]:
    """The route's work for a batch of heartbeats in the calling thread, for
    ``api.heartbeat_fast``: per beat the reply's JSON, or None when the route must answer
    it (not a JSON heartbeat, a wrong token, a failure of its own). Raises when the
    batch's refresh fails: the route then answers each beat.

    One trip to a thread does the batch — per beat the token and the body parsed by
    pydantic from the bytes, then one refresh for all (``services.nodes.refresh_many``:
    one read and the UPDATEs, in autocommit), and the replies — where the route takes
    four trips per beat (its dependencies, the endpoint, the commit), each a wait for
    the GIL under load. A new node or a card gone takes the route's transaction, its own
    session committed before the answer, as with the DB dependency; a session committed
    in its own trip never waits for a thread while it holds a connection (a burst of
    registrations once deadlocked the pool that way).
    """
    parsed = [_parsed(ctx, beat) for beat in beats]
    with ctx.db.autocommit() as conn:
        refreshed = iter(
            nodes.refresh_many(conn, ctx.clock, [hb for hb in parsed if hb is not None])
        )
    replies: list[bytes | None] = []
    for beat, hb in zip(beats, parsed, strict=True):
        reply = None
        if hb is not None:
            reply = next(refreshed)
            if reply is None:  # a new node, a card gone
                reply = _registered(ctx, beat, hb)
        replies.append(None if reply is None else _keyed(ctx, reply).model_dump_json().encode())
    return replies


def _parsed(ctx: ServerContext, beat: Beat) -> Heartbeat | None:
    """The beat's body, if it is a JSON heartbeat sent with a valid node token."""
    request = Request(beat.scope)
    headers = request.headers
    if headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/json":
        return None
    try:
        get_node_id(request, ctx, headers.get("authorization"), headers.get("x-heteroflow-node"))
        return Heartbeat.model_validate_json(beat.body)
    except (Unauthorized, ValidationError):
        return None


def _registered(ctx: ServerContext, beat: Beat, hb: Heartbeat) -> HeartbeatReply | None:
    """A beat the refresh left (a new node, a card gone), in the route's transaction;
    None when that fails (the route tries it again and answers)."""
    token = REQUEST_ID.set(beat.request_id)
    try:
        with ctx.db.session() as s:  # committed before the answer, as with the DB dependency
            return nodes.heartbeat(s, ctx.clock, hb)
    except Exception as exc:  # the route answers it, as it answers every error
        log.debug("heartbeat of %s handed to the route: %s: %s", hb.name,
                  type(exc).__name__, exc)
        return None
    finally:
        REQUEST_ID.reset(token)


@router.post("/agent/tasks/{task_id}/claim", response_model=TaskAssignment, tags=["agent"])
def claim(task_id: IdStr, ctx: Ctx, s: DB, node: AgentNode) -> TaskAssignment:
    t = nodes.claim(s, ctx.clock, node, task_id,
                    offline_after_s=ctx.settings.node_offline_after_s)
    t.engine_key = ctx.engine_key(t.id)
    # H7: the pull's login travels as the engine key does: to the claiming agent only
    t.registry_auth = registry_credentials.auth_for_task(s, ctx.sealer, t.id, t.image)
    t.hub_token = hub_tokens.token_for_task(s, ctx.sealer, t.id, t.model_path)  # H9, as H7
    return t


@router.get("/agent/prepulls", response_model=list[PrepullAsk], tags=["agent"])
def prepulls(ctx: Ctx, s: DB, node: AgentNode) -> list[PrepullAsk]:
    """The images a recreate asks this node to pull before anything stops (J2, H7)."""
    return [
        # H7: the pull's login travels as a claim's: to this node's agent only
        PrepullAsk(task_id=tid, image=image,
                   registry_auth=registry_credentials.auth_for_task(s, ctx.sealer, tid, image))
        for tid, image in prepull.asks(s, node)
    ]


@router.post("/agent/tasks/{task_id}/prepull", tags=["agent"])
def prepulled(
    task_id: IdStr, rep: PrepullReport, ctx: Ctx, s: DB, node: AgentNode
) -> dict[str, str]:
    prepull.record(s, ctx.clock, node, task_id, rep)
    return {"outcome": rep.outcome}


@router.post("/agent/tasks/{task_id}/report", tags=["agent"])
def report(task_id: IdStr, rep: TaskReport, ctx: Ctx, s: DB, node: AgentNode) -> dict[str, str]:
    return {"status": nodes.report(s, ctx.clock, node, task_id, rep)}
