"""A service's LoRA adapters (/api/v1/task-groups/{id}/adapters; core.lora)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.adapters import AdapterCreate, AdaptersRead
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.task_groups import MODEL_NAME_PATTERN
from heteroflow.services.serving import adapters

router = api_router(prefix="/api/v1", tags=["task-groups"])

AdapterName = Annotated[str, Path(max_length=256, pattern=MODEL_NAME_PATTERN)]


@router.get("/task-groups/{group_id}/adapters", response_model=AdaptersRead)
def list_adapters(group_id: IdStr, s: DB, who: Who) -> AdaptersRead:
    """The service's adapters and how many its engines hold at once (``max_loras``)."""
    return adapters.list_adapters(s, who, group_id)


@router.post("/task-groups/{group_id}/adapters", response_model=AdaptersRead, status_code=201)
def add_adapter(
    group_id: IdStr, req: AdapterCreate, ctx: Ctx, s: DB, who: Who
) -> AdaptersRead:
    """Serve a LoRA adapter under its own model name beside the service's model: the
    service's keys may call it at once, its running engines load it at runtime (no
    restart). 409 when the service has no LoRA slots (``max_loras`` 0) or every slot is
    taken, or the name is a model name of the tenant already; 400 naming ``path``."""
    return adapters.add_adapter(
        s, who, ctx.clock, group_id, req, offline_after_s=ctx.settings.node_offline_after_s
    )


@router.delete("/task-groups/{group_id}/adapters/{name:path}", response_model=AdaptersRead)
def remove_adapter(
    group_id: IdStr, name: AdapterName, ctx: Ctx, s: DB, who: Who
) -> AdaptersRead:
    """Stop serving an adapter: its name stops routing now, the engines unload it."""
    return adapters.remove_adapter(s, who, ctx.clock, group_id, name)
