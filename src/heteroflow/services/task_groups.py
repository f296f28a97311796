"""Task groups: create (group + tasks + route + endpoint/key), read, delete, stop a task."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import DEFAULT_ENV_ALLOW
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.ids import key_display_prefix, new_api_key, new_id
from heteroflow.core.placement import Reservation
from heteroflow.core.ports import ports_to_dicts
from heteroflow.core.states import GroupStatus, TaskStatus
from heteroflow.db.tables import Event, InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.schemas.routing import hash_key
from heteroflow.schemas.task_groups import (
    TaskGroupCreate,
    TaskGroupCreated,
    TaskGroupRead,
    TaskRead,
)
from heteroflow.services.access import visible_task
from heteroflow.services.auth import Principal
from heteroflow.services.fleet import read_fleet
from heteroflow.services.planning import GroupPlan, plan_group
from heteroflow.services.transitions import refresh_group_status, transition
from heteroflow.services.views import group_read, task_read

log = logging.getLogger(__name__)


def create_group(
    s: Session,
    who: Principal,
    clock: Clock,
    req: TaskGroupCreate,
    reservation: Reservation | None = None,
    env_allow: Sequence[str] = DEFAULT_ENV_ALLOW,
    *,
    offline_after_s: float,
) -> TaskGroupCreated:
    """Plan on the fleet as its dry run sees it (online by ``node_offline_after_s``),
    then write the group, its tasks, route and endpoint."""
    fleet = read_fleet(s, clock, offline_after_s)
    plan = plan_group(s, who, req, fleet, reservation or Reservation(), env_allow)
    return _write(s, who, clock, plan)


def _write(s: Session, who: Principal, clock: Clock, plan: GroupPlan) -> TaskGroupCreated:
    req, spec = plan.req, plan.req.task
    now = clock.now()
    model_name = plan.model_name
    group = TaskGroup(
        id=new_id("tg"),
        tenant_id=who.tenant_id,
        created_by=who.user_id,
        name=req.name,
        model_name=model_name,
        task_type=plan.task_type,
        parallelism=req.parallelism,
        world_size=plan.world_size,
        current_replicas=plan.replicas,
        min_replicas=plan.replicas,
        max_replicas=plan.replicas,
        enable_api=plan.enable_api,
        endpoint_id=None,
        inference_templates=list(plan.templates),
        current_generation=1,
        idle_timeout_minutes=req.idle_timeout_minutes,
        gpu_memory_utilization=req.gpu_memory_utilization,
        priority=req.priority,
        priority_class=req.priority_class,
        health_check=plan.health,
        scale_policy={},
        schedule_window={},
        labels=dict(req.labels),
        status=GroupStatus.PENDING.value,
        status_message="",
        created_at=now,
        updated_at=now,
    )
    s.add(group)
    s.flush()
    tasks = [
        Task(
            id=new_id("task"),
            group_id=group.id,
            tenant_id=who.tenant_id,
            name=spec.name or f"{req.name}-{rank}",
            rank=rank,
            generation=1,
            task_type=plan.task_type,
            status=TaskStatus.PENDING.value,
            status_message="waiting for the scheduler",
            gpu_required=plan.gpus_per_task,
            gpu_type=spec.gpu_type,
            gpu_ids=[],
            model_path=spec.model_path,
            model_name=model_name,
            image=plan.req.task.image,
            engine=plan.engine,
            engine_reason=plan.engine_reason,
            command=list(spec.command),
            engine_args=list(spec.engine_args),
            env=list(spec.env),
            ports=ports_to_dicts(plan.ports),
            estimated_gpu_memory_mb=plan.estimated_gpu_memory_mb,
            estimate_detail=plan.estimate.detail if plan.estimate else "",
            memory_mb=plan.memory_mb,
            kv_offload_gb=spec.kv_offload_gb,
            gpu_memory_utilization=req.gpu_memory_utilization,
            priority=req.priority,
            priority_class=req.priority_class,
            health_check=plan.health,
            created_at=now,
            updated_at=now,
        )
        for rank in range(plan.replicas)
    ]
    s.add_all(tasks)
    s.flush()

    warnings: list[str] = list(plan.warnings)
    api_key: str | None = None
    try:
        with s.begin_nested():
            s.add(
                ModelRoute(
                    id=new_id("mr"),
                    tenant_id=who.tenant_id,
                    group_id=group.id,
                    model_name=model_name,
                    priority=0,
                    weight=100,
                    version="v1",
                    active=True,
                    algorithm="round_robin",
                    created_at=now,
                    updated_at=now,
                )
            )
    except Exception:
        log.warning("model route for group %s not created", group.id, exc_info=True)
        warnings.append("the model route could not be created; add one later")
    if plan.enable_api:
        try:
            with s.begin_nested():
                api_key = new_api_key()
                endpoint = InferenceEndpoint(
                    id=new_id("ep"),
                    tenant_id=who.tenant_id,
                    group_id=group.id,
                    name=plan.endpoint_name,
                    port=plan.endpoint_port,
                    external_port=req.external_port,
                    key_hash=hash_key(api_key),
                    key_prefix=key_display_prefix(api_key),
                    created_by=who.user_id,
                    created_at=now,
                    updated_at=now,
                )
                s.add(endpoint)
                s.flush()
                group.endpoint_id = endpoint.id
        except Exception:
            api_key = None
            log.warning("endpoint for group %s not created", group.id, exc_info=True)
            warnings.append("the endpoint could not be created; the service has no API key")
    s.flush()
    read = group_read(group, tasks)
    return TaskGroupCreated(**read.model_dump(), api_key=api_key, warnings=warnings)


def _visible_group(s: Session, who: Principal, group_id: str) -> TaskGroup:
    g = s.get(TaskGroup, group_id)
    if g is None or g.deleted_at is not None or (
        not who.is_operator and g.tenant_id != who.tenant_id
    ):
        raise NotFound(f"task group {group_id!r} not found")
    return g


def _tasks_of(s: Session, group_ids: list[str]) -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {g: [] for g in group_ids}
    if group_ids:
        for t in s.scalars(select(Task).where(Task.group_id.in_(group_ids))):
            out[t.group_id].append(t)
    return out


def list_groups(s: Session, who: Principal) -> list[TaskGroupRead]:
    q = select(TaskGroup).where(TaskGroup.deleted_at.is_(None)).order_by(TaskGroup.created_at)
    if not who.is_operator:
        q = q.where(TaskGroup.tenant_id == who.tenant_id)
    groups = list(s.scalars(q))
    tasks = _tasks_of(s, [g.id for g in groups])
    return [group_read(g, tasks[g.id]) for g in groups]


def get_group(s: Session, who: Principal, group_id: str) -> TaskGroupRead:
    g = _visible_group(s, who, group_id)
    return group_read(g, _tasks_of(s, [g.id])[g.id])


def _stop(s: Session, clock: Clock, task: Task, reason: str) -> None:
    """Ask a task to stop; retried on a lost CAS race (the agent may have moved it)."""
    for _ in range(5):
        status = TaskStatus(
            s.scalar(select(Task.status).where(Task.id == task.id).execution_options(
                populate_existing=True))
            or TaskStatus.STOPPED
        )
        if status in (TaskStatus.PENDING, TaskStatus.SCHEDULED, TaskStatus.FAILED,
                      TaskStatus.COMPLETED):
            to = TaskStatus.STOPPED
        elif status in (TaskStatus.STARTING, TaskStatus.RUNNING):
            to = TaskStatus.STOPPING
        else:
            return  # already stopping or stopped
        if transition(s, clock, task.id, status, to, reason):
            return
    raise Conflict(f"task {task.id} kept changing state; retry")


def delete_group(s: Session, who: Principal, clock: Clock, group_id: str) -> None:
    g = _visible_group(s, who, group_id)
    g.deleted_at = clock.now()
    # written first: this row lock orders the delete against route creation
    # (endpoints.lock_live_group), so no route is added to a group being deleted
    s.flush()
    for t in s.scalars(select(Task).where(Task.group_id == g.id)):
        _stop(s, clock, t, f"task group {g.id} deleted")
    for e in s.scalars(select(InferenceEndpoint).where(InferenceEndpoint.group_id == g.id)):
        s.delete(e)
    for r in s.scalars(select(ModelRoute).where(ModelRoute.group_id == g.id)):
        s.delete(r)
    g.endpoint_id = None
    refresh_group_status(s, clock, g.id, "deleted")


def get_task(s: Session, who: Principal, task_id: str) -> TaskRead:
    return task_read(visible_task(s, who, task_id))


def stop_task(s: Session, who: Principal, clock: Clock, task_id: str) -> TaskRead:
    t = visible_task(s, who, task_id)
    _stop(s, clock, t, f"stopped by {who.username}")
    s.refresh(t)
    return task_read(t)


def group_events(s: Session, who: Principal, group_id: str) -> list[dict[str, Any]]:
    _visible_group(s, who, group_id)
    rows = s.scalars(select(Event).where(Event.group_id == group_id).order_by(Event.id))
    return [
        {
            "task_id": e.task_id,
            "kind": e.kind,
            "from_status": e.from_status,
            "to_status": e.to_status,
            "message": e.message,
            "created_at": e.created_at,
        }
        for e in rows
    ]
