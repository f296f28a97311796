"""Row -> wire conversions (the API never returns ORM objects)."""

from __future__ import annotations

from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities
from heteroflow.db.tables import InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.schemas.capabilities import CapabilitiesRead
from heteroflow.schemas.gateway import EndpointRead, ModelRouteRead
from heteroflow.schemas.task_groups import TaskGroupRead, TaskRead
from heteroflow.services.capabilities import of_tasks


def task_read(t: Task) -> TaskRead:
    return TaskRead(
        id=t.id,
        group_id=t.group_id,
        name=t.name,
        rank=t.rank,
        generation=t.generation,
        task_type=t.task_type,
        status=t.status,
        status_message=t.status_message,
        gpu_required=t.gpu_required,
        gpu_type=t.gpu_type,
        gpu_ids=list(t.gpu_ids),
        node_id=t.node_id,
        model_path=t.model_path,
        image=t.image,
        engine=t.engine,
        engine_reason=t.engine_reason,
        ports=list(t.ports),
        estimated_gpu_memory_mb=t.estimated_gpu_memory_mb,
        estimate_detail=t.estimate_detail,
        memory_mb=t.memory_mb,
        kv_offload_gb=t.kv_offload_gb,
        launch_argv=list(t.launch_argv),
        qos=t.qos,
        preempted_by=t.preempted_by,
        priority=t.priority,
        priority_class=t.priority_class,
        draining=bool(t.draining),
        rebuild_count=t.rebuild_count,
        replaced_by=t.replaced_by,
        running_at=t.running_at,
        wake_requested=bool(t.wake_requested),
        started_at=t.started_at,
        created_at=t.created_at,
        updated_at=t.updated_at,
    )


def group_read(g: TaskGroup, tasks: list[Task]) -> TaskGroupRead:
    return TaskGroupRead(
        id=g.id,
        tenant_id=g.tenant_id,
        name=g.name,
        model_name=g.model_name,
        task_type=g.task_type,
        parallelism=g.parallelism,
        world_size=g.world_size,
        current_replicas=g.current_replicas,
        min_replicas=g.min_replicas,
        max_replicas=g.max_replicas,
        enable_api=g.enable_api,
        endpoint=g.endpoint_id,
        inference_templates=list(g.inference_templates),
        current_generation=g.current_generation,
        rolling_update_state=g.rolling_update_state,
        rolling_update_message=g.rolling_update_message,
        idle_timeout_minutes=g.idle_timeout_minutes,
        gpu_memory_utilization=g.gpu_memory_utilization,
        priority=g.priority,
        priority_class=g.priority_class,
        desired=g.desired,
        run_timeout_seconds=g.run_timeout_seconds,
        last_request_at=g.last_request_at,
        scale_policy=dict(g.scale_policy),
        schedule_window=dict(g.schedule_window),
        window_action=g.window_action,
        window_saved_replicas=g.window_saved_replicas,
        health_check=dict(g.health_check),
        labels=dict(g.labels),
        status=g.status,
        status_message=g.status_message,
        created_at=g.created_at,
        updated_at=g.updated_at,
        tasks=[
            task_read(t)
            for t in sorted(tasks, key=lambda t: (t.generation, t.rank))
            if not t.replaced_by
        ],
        capabilities=CapabilitiesRead.of(of_tasks(tasks)),
    )


def endpoint_read(e: InferenceEndpoint, *, shared: bool = False) -> EndpointRead:
    """``shared``: its group is another tenant's, read by a member: its id is not shown
    (issue 26; ``endpoints.foreign_groups``)."""
    return EndpointRead(
        id=e.id,
        tenant_id=e.tenant_id,
        group_id="" if shared else e.group_id,
        name=e.name,
        port=e.port,
        external_port=e.external_port,
        key_prefix=e.key_prefix,
        rpm_limit=e.rpm_limit or 0,
        tpm_limit=e.tpm_limit or 0,
        quota_tokens=e.quota_tokens or 0,
        quota_period=e.quota_period or "",
        created_at=e.created_at,
        updated_at=e.updated_at,
    )


def route_read(
    r: ModelRoute, capabilities: Capabilities = UNKNOWN, *, shared: bool = False
) -> ModelRouteRead:
    """``shared``: as ``endpoint_read``'s."""
    return ModelRouteRead(
        id=r.id,
        tenant_id=r.tenant_id,
        group_id="" if shared else r.group_id,
        model_name=r.model_name,
        priority=r.priority,
        weight=r.weight,
        version=r.version,
        active=r.active,
        algorithm=r.algorithm,
        tags=[str(tag) for tag in r.tags or ()],
        added=bool(r.added),
        capabilities=CapabilitiesRead.of(capabilities),
    )
