"""Task groups (/api/v1/task-groups) and tasks (/api/v1/tasks)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.task_groups import (
    DryRunPlan,
    EventRead,
    TaskGroupCreate,
    TaskGroupCreated,
    TaskGroupPatch,
    TaskGroupRead,
    TaskRead,
)
from heteroflow.services import task_groups
from heteroflow.services.dry_run import dry_run as plan_dry_run

router = APIRouter(prefix="/api/v1", tags=["task-groups"])


@router.post(
    "/task-groups",
    response_model=TaskGroupCreated | DryRunPlan,
    status_code=201,
    responses={200: {"model": DryRunPlan, "description": "dry_run=true: the plan only"}},
)
def create_group(
    req: TaskGroupCreate, ctx: Ctx, s: DB, who: Who, response: Response, dry_run: bool = False
) -> TaskGroupCreated | DryRunPlan:
    settings = ctx.settings
    if dry_run:
        response.status_code = 200
        return plan_dry_run(
            s,
            who,
            ctx.clock,
            req,
            offline_after_s=settings.node_offline_after_s,
            reservation=settings.reservation(),
            port_pool=settings.port_pool(),
            policy=settings.placement_policy(),
            env_allow=settings.env_allow(),
        )
    return task_groups.create_group(
        s, who, ctx.clock, req, settings.reservation(), settings.env_allow(),
        offline_after_s=settings.node_offline_after_s,
    )


@router.get("/task-groups", response_model=list[TaskGroupRead])
def list_groups(s: DB, who: Who) -> list[TaskGroupRead]:
    return task_groups.list_groups(s, who)


@router.get("/task-groups/{group_id}", response_model=TaskGroupRead)
def get_group(group_id: IdStr, s: DB, who: Who) -> TaskGroupRead:
    return task_groups.get_group(s, who, group_id)


@router.get("/task-groups/{group_id}/events", response_model=list[EventRead])
def group_events(group_id: IdStr, s: DB, who: Who) -> list[dict[str, Any]]:
    return [
        {"group_id": group_id, **e} for e in task_groups.group_events(s, who, group_id)
    ]


@router.patch("/task-groups/{group_id}", response_model=TaskGroupRead)
def patch_group(
    group_id: IdStr, req: TaskGroupPatch, ctx: Ctx, s: DB, who: Who
) -> TaskGroupRead:
    """D4: change ``health_check`` and / or ``idle_timeout_minutes`` alone — no new
    generation, no new task; agents apply a new health check at their next heartbeat.
    Any other field: 400 naming it."""
    return task_groups.patch_group(s, who, ctx.clock, group_id, req)


@router.post("/task-groups/{group_id}/stop", response_model=TaskGroupRead)
def stop_group(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> TaskGroupRead:
    """Stop the service (``desired`` stopped): its tasks stop, the recovery loop leaves
    it alone. Stopping a stopped service changes nothing."""
    return task_groups.stop_group(s, who, ctx.clock, group_id)


@router.post("/task-groups/{group_id}/start", response_model=TaskGroupRead)
def start_group(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> TaskGroupRead:
    """Start a stopped or failed service (``desired`` running): every rank without a live
    task gets a fresh one (the rebuild count starts over). 409 when it already runs."""
    return task_groups.start_group(s, who, ctx.clock, group_id)


@router.delete("/task-groups/{group_id}", status_code=204)
def delete_group(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> Response:
    task_groups.delete_group(s, who, ctx.clock, group_id)
    return Response(status_code=204)


@router.get("/tasks/{task_id}", response_model=TaskRead)
def get_task(task_id: IdStr, s: DB, who: Who) -> TaskRead:
    return task_groups.get_task(s, who, task_id)


@router.post("/tasks/{task_id}/stop", response_model=TaskRead)
def stop_task(task_id: IdStr, ctx: Ctx, s: DB, who: Who) -> TaskRead:
    return task_groups.stop_task(s, who, ctx.clock, task_id)
