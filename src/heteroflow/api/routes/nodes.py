"""Nodes (/api/v1/nodes) and the agent protocol (/api/v1/agent)."""

from __future__ import annotations

from fastapi import APIRouter

from heteroflow.api.deps import DB, AgentNode, Ctx, Who
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


@router.post("/agent/heartbeat", response_model=HeartbeatReply, tags=["agent"])
def heartbeat(hb: Heartbeat, ctx: Ctx, s: DB, _node: AgentNode) -> HeartbeatReply:
    return nodes.heartbeat(s, ctx.clock, hb)


@router.post("/agent/tasks/{task_id}/claim", response_model=TaskAssignment, tags=["agent"])
def claim(task_id: IdStr, ctx: Ctx, s: DB, node: AgentNode) -> TaskAssignment:
    return nodes.claim(s, ctx.clock, node, task_id)


@router.post("/agent/tasks/{task_id}/report", tags=["agent"])
def report(task_id: IdStr, rep: TaskReport, ctx: Ctx, s: DB, node: AgentNode) -> dict[str, str]:
    return {"status": nodes.report(s, ctx.clock, node, task_id, rep)}
