"""Draining a task (M11): POST marks it, DELETE clears it (/api/v1/tasks/{id}/drain)."""

from __future__ import annotations

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.task_groups import TaskRead
from heteroflow.services.lifecycle import draining

router = api_router(prefix="/api/v1", tags=["task-groups"])


@router.post("/tasks/{task_id}/drain", response_model=TaskRead)
def drain_task(task_id: IdStr, ctx: Ctx, s: DB, who: Who) -> TaskRead:
    """The gateway sends the task no new requests; requests in flight finish."""
    return draining.set_draining(s, who, ctx.clock, task_id, True)


@router.delete("/tasks/{task_id}/drain", response_model=TaskRead)
def undrain_task(task_id: IdStr, ctx: Ctx, s: DB, who: Who) -> TaskRead:
    """The task takes new requests again."""
    return draining.set_draining(s, who, ctx.clock, task_id, False)
