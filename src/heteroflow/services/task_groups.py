"""Task groups: create (group + tasks + route + endpoint/key), read, delete, stop a task."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.engines import (
    CPU_CAPABLE,
    LLAMACPP_AGENT_FLAGS,
    owned_flag_in,
    resolve_engine,
)
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.core.ids import key_display_prefix, new_api_key, new_id
from heteroflow.core.states import GroupStatus, TaskStatus
from heteroflow.db.tables import Event, InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.gateway.snapshot import hash_key
from heteroflow.schemas.task_groups import (
    HealthCheckIn,
    TaskGroupCreate,
    TaskGroupCreated,
    TaskGroupRead,
    TaskRead,
)
from heteroflow.services.auth import Principal
from heteroflow.services.transitions import refresh_group_status, transition
from heteroflow.services.views import group_read, task_read

log = logging.getLogger(__name__)

DEFAULT_CONTAINER_PORT = 8000


def infer_task_type(req: TaskGroupCreate, engine: str) -> str:
    """Explicit wins; else inference when model_path, enable_api or an engine image says so."""
    if req.task_type:
        return req.task_type
    if req.task.model_path or req.enable_api or engine:
        return "inference"
    return "container"


def _replica_shape(req: TaskGroupCreate) -> tuple[int, int]:
    """(number of tasks, GPUs per task) for the requested parallelism."""
    gpus = req.task.gpu_required
    if req.parallelism == "pipeline":
        raise ValidationFailed(
            "parallelism 'pipeline' needs gang placement across nodes, which this release "
            "does not have yet; use single, tensor_parallel or split",
            field="parallelism",
        )
    if req.parallelism == "tensor_parallel":
        if req.world_size < 2:
            raise ValidationFailed("tensor_parallel needs world_size >= 2", field="world_size")
        return 1, req.world_size
    if req.parallelism == "split":
        return req.world_size, gpus
    return 1, gpus


def create_group(
    s: Session, who: Principal, clock: Clock, req: TaskGroupCreate
) -> TaskGroupCreated:
    spec = req.task
    engine, engine_reason = resolve_engine(
        spec.engine, req.labels.get("heteroflow.engine", ""), spec.image
    )
    task_type = infer_task_type(req, engine)
    enable_api = req.enable_api or bool(spec.model_path)
    ports = [p.model_dump() for p in spec.ports] or [
        {"container_port": DEFAULT_CONTAINER_PORT, "host_port": 0}
    ]
    container_ports = [p["container_port"] for p in ports]
    replicas, gpus_per_task = _replica_shape(req)

    if task_type == "inference" and not spec.model_path and not spec.command:
        raise ValidationFailed(
            "an inference service needs task.model_path (or a custom task.command); "
            "without it every engine fails to start",
            field="task.model_path",
        )
    if gpus_per_task == 0 and task_type == "inference" and engine not in CPU_CAPABLE:
        raise ValidationFailed(
            f"gpu_required 0 runs on the CPU, which only {', '.join(sorted(CPU_CAPABLE))} "
            f"can do; engine is {engine or 'unresolved'}",
            field="task.gpu_required",
        )
    if engine == "llamacpp":
        clash = owned_flag_in(spec.engine_args, LLAMACPP_AGENT_FLAGS)
        if clash:
            raise ValidationFailed(
                f"engine_args may not set {clash}: the platform sets the model, host, port "
                "and alias itself",
                field="task.engine_args",
            )
    for i, item in enumerate(spec.env):
        if "=" in item and not item.split("=", 1)[0]:
            raise ValidationFailed(f"env[{i}] has an empty name", field=f"task.env[{i}]")
    endpoint_port = req.endpoint_port or container_ports[0]
    if req.endpoint_port and not who.is_operator and req.endpoint_port not in container_ports:
        raise ValidationFailed(
            f"endpoint_port {req.endpoint_port} is not one of the group's container ports "
            f"{container_ports}",
            field="endpoint_port",
        )
    health = (req.health_check or HealthCheckIn()).model_dump()
    if health["port"] is None:
        health["port"] = container_ports[0]
    elif health["port"] not in container_ports:
        raise ValidationFailed(
            f"health_check.port {health['port']} is not a container port {container_ports}",
            field="health_check.port",
        )

    endpoint_name = req.endpoint_name or req.name
    if enable_api:
        clash = s.scalar(
            select(InferenceEndpoint.id).where(
                InferenceEndpoint.tenant_id == who.tenant_id,
                InferenceEndpoint.name == endpoint_name,
            )
        )
        if clash is not None:
            raise Conflict(
                f"an endpoint named {endpoint_name!r} already exists in this tenant",
                field="endpoint_name" if req.endpoint_name else "name",
            )

    now = clock.now()
    model_name = req.model_name or req.name
    group = TaskGroup(
        id=new_id("tg"),
        tenant_id=who.tenant_id,
        created_by=who.user_id,
        name=req.name,
        model_name=model_name,
        task_type=task_type,
        parallelism=req.parallelism,
        world_size=replicas * gpus_per_task if req.parallelism != "split" else req.world_size,
        current_replicas=replicas,
        min_replicas=replicas,
        max_replicas=replicas,
        enable_api=enable_api,
        endpoint_id=None,
        inference_templates=[],
        current_generation=1,
        idle_timeout_minutes=req.idle_timeout_minutes,
        gpu_memory_utilization=req.gpu_memory_utilization,
        priority=req.priority,
        health_check=health,
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
            task_type=task_type,
            status=TaskStatus.PENDING.value,
            status_message="waiting for the scheduler",
            gpu_required=gpus_per_task,
            gpu_type=spec.gpu_type,
            gpu_ids=[],
            model_path=spec.model_path,
            model_name=model_name,
            image=spec.image,
            engine=engine,
            engine_reason=engine_reason,
            command=list(spec.command),
            engine_args=list(spec.engine_args),
            env=list(spec.env),
            ports=[dict(p) for p in ports],
            estimated_gpu_memory_mb=spec.estimated_gpu_memory_mb,
            memory_mb=spec.memory_mb,
            gpu_memory_utilization=req.gpu_memory_utilization,
            priority=req.priority,
            health_check=health,
            created_at=now,
            updated_at=now,
        )
        for rank in range(replicas)
    ]
    s.add_all(tasks)
    s.flush()

    warnings: list[str] = []
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
    if enable_api:
        try:
            with s.begin_nested():
                api_key = new_api_key()
                endpoint = InferenceEndpoint(
                    id=new_id("ep"),
                    tenant_id=who.tenant_id,
                    group_id=group.id,
                    name=endpoint_name,
                    port=endpoint_port,
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
    for t in s.scalars(select(Task).where(Task.group_id == g.id)):
        _stop(s, clock, t, f"task group {g.id} deleted")
    for e in s.scalars(select(InferenceEndpoint).where(InferenceEndpoint.group_id == g.id)):
        s.delete(e)
    for r in s.scalars(select(ModelRoute).where(ModelRoute.group_id == g.id)):
        s.delete(r)
    g.endpoint_id = None
    refresh_group_status(s, clock, g.id, "deleted")


def _visible_task(s: Session, who: Principal, task_id: str) -> Task:
    t = s.get(Task, task_id)
    if t is None or (not who.is_operator and t.tenant_id != who.tenant_id):
        raise NotFound(f"task {task_id!r} not found")
    return t


def get_task(s: Session, who: Principal, task_id: str) -> TaskRead:
    return task_read(_visible_task(s, who, task_id))


def stop_task(s: Session, who: Principal, clock: Clock, task_id: str) -> TaskRead:
    t = _visible_task(s, who, task_id)
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
