"""Task groups (/api/v1/task-groups) and tasks (/api/v1/tasks)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, Request, Response

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.task_groups import (
    DryRunPlan,
    EventRead,
    ScalePolicyIn,  # issue 14 (scaling)
    ScaleRequest,  # issue 14 (scaling)
    TaskGroupCreate,
    TaskGroupCreated,
    TaskGroupPatch,
    TaskGroupRead,
    TaskGroupUpdate,
    TaskRead,
)
from heteroflow.schemas.windows import ScheduleWindowIn, ScheduleWindowRead  # issue 14 (K1)
from heteroflow.services.lifecycle import rollout, task_groups, windows  # windows: issue 14 (K1)
from heteroflow.services.lifecycle.scaling import scale_group as scale_service  # issue 14 (I2)
from heteroflow.services.lifecycle.scaling import set_scale_policy as set_policy  # issue 14 (I1)
from heteroflow.services.placement.dry_run import dry_run as plan_dry_run
from heteroflow.services.placement.sources import resolve_source
from heteroflow.services.tenancy import hub_tokens  # issue 29 (H9)

router = api_router(prefix="/api/v1", tags=["task-groups"])


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
    # issue 29: a model source resolves (or is a 400) before the database is read; a hub
    # is asked with the tenant's own token (read in its own short session), H9
    source = resolve_source(req, settings, hub_tokens.reader(ctx.db, ctx.sealer, who.tenant_id))
    if dry_run:
        response.status_code = 200
        plan = plan_dry_run(
            s,
            who,
            ctx.clock,
            req,
            offline_after_s=settings.node_offline_after_s,
            reservation=settings.reservation(),
            port_pool=settings.port_pool(),
            policy=settings.placement_policy(),
            env_allow=settings.env_allow(),
            model_source=source,  # shown with the nodes whose cache holds it
        )
        return plan
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


@router.put("/task-groups/{group_id}/update", response_model=TaskGroupRead)
def update_group(
    group_id: IdStr, req: TaskGroupUpdate, request: Request, ctx: Ctx, s: DB, who: Who
) -> TaskGroupRead:
    """J1-J3: a new generation of every replica with the given task intent changed —
    ``rolling`` (batch by batch; the old replicas drain before they stop; a failing batch
    is tried again, then the update rolls back) or ``recreate`` (stop all, create all).
    Answers at once with ``current_generation`` bumped and ``rolling_update_state``;
    follow it there (and on the events). 409 while another update runs or the service
    is stopped or asleep; 400 naming a bad field — the new generation is checked by the
    create's own rule, so an update that cannot run is refused here."""
    return rollout.start_update(
        s, who, ctx.clock, group_id, req,
        holder=str(request.app.state.instance_id),
        policy=ctx.settings.rollout_policy(),
        env_allow=ctx.settings.env_allow(),
        offline_after_s=ctx.settings.node_offline_after_s,
    )


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


# --- issue 14 (I1, I2): scaling ---
@router.put("/task-groups/{group_id}/scale", response_model=TaskGroupRead)
def scale_group(
    group_id: IdStr, req: ScaleRequest, ctx: Ctx, s: DB, who: Who
) -> TaskGroupRead:
    """I2: set the replica count within [min_replicas, max_replicas] (400 naming
    ``replicas``). New replicas copy the current ones' task intent and are placed by
    the scheduler; the highest ranks leave first (never rank 0): a running one drains
    (no new requests) and stops once the gateways report nothing in flight on it. 409
    when the service is stopped, asleep, being updated or outside its schedule window;
    404 for another tenant's service. With autoscaling on, the autoscaler may change the
    count again at its next round."""
    return scale_service(s, who, ctx.clock, group_id, req.replicas)


@router.put("/task-groups/{group_id}/scale-policy", response_model=TaskGroupRead)
def set_scale_policy(
    group_id: IdStr, req: ScalePolicyIn, ctx: Ctx, s: DB, who: Who
) -> TaskGroupRead:
    """I1: autoscaling (``enabled``, ``metric``: inflight | tokens_per_s | queue |
    kv_cache, ``target`` per replica) and the bounds (``min_replicas``,
    ``max_replicas``). A field left out keeps its stored value. A count outside new
    bounds moves to the nearest bound at once (409 when it cannot now)."""
    return set_policy(s, who, ctx.clock, group_id, req)
# --- end issue 14 (scaling) ---


# --- issue 14 (K1): schedule windows. The body is validated by the service so that an
# error names its field as schedule_window.<field>, as it does at create. ---
_WINDOW_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ScheduleWindowIn.model_json_schema()}},
    }
}


@router.put(
    "/task-groups/{group_id}/schedule-window",
    response_model=ScheduleWindowRead,
    openapi_extra=_WINDOW_BODY,
)
def set_schedule_window(
    group_id: IdStr, ctx: Ctx, s: DB, who: Who, body: Annotated[Any, Body()] = None
) -> ScheduleWindowRead:
    """K1: when the service serves. Outside the window the leader (within
    ``schedule_window_interval_s``) pauses it (sleep), scales it down to ``replicas`` or
    stops it; back inside, a pause or scale is undone (a stop is not). Replaces any window;
    ``{"enabled": false}`` keeps it but undoes what it has in effect. 400 naming the
    field (``schedule_window.timezone``...), 404 for another tenant's group, 409 once
    deleted."""
    return windows.set_window(s, who, ctx.clock, group_id, body)


@router.get("/task-groups/{group_id}/schedule-window", response_model=ScheduleWindowRead)
def get_schedule_window(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> ScheduleWindowRead:
    """K1: the window, inside or outside it now and until when, what it has in effect."""
    return windows.get_window(s, who, ctx.clock, group_id)


@router.delete("/task-groups/{group_id}/schedule-window", response_model=ScheduleWindowRead)
def remove_schedule_window(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> ScheduleWindowRead:
    """K1: remove the window; what it has in effect is undone at the next round."""
    return windows.remove_window(s, who, ctx.clock, group_id)
# --- end issue 14 (K1) ---
