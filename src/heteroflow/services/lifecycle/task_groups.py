"""Task groups: create (group + tasks + route + endpoint/key), read, delete, stop a task;
stop / start a whole group (its ``desired`` state) and change what may change alone (D4).

A create writes the group, its tasks, route and endpoint (with its key) in the caller's
one unit of work: all of them or, on any error, none. Two creates of one endpoint name
at once both pass the planning read; the database's unique constraint lets one commit
and the other answers 409 naming the field (services/unique.py) — never a service
without its key.

``desired`` is the owner's word: "running" (the recovery loop rebuilds what fails) or
"stopped" (a user stop, the only thing that stops a service; the loop leaves it alone).
A stop moves every current task through the state door to stopping / stopped; a start
gives every rank without a live current task a fresh pending task (``rebuild_count`` 0,
through ``recovery.replace``), so a service the loop gave up on can be started again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import DEFAULT_ENV_ALLOW
from heteroflow.core.errors import Conflict, ValidationFailed
from heteroflow.core.events import EventKind
from heteroflow.core.ids import key_display_prefix, new_api_key, new_id
from heteroflow.core.placement import Reservation
from heteroflow.core.ports import ports_from_dicts, ports_to_dicts
from heteroflow.core.states import TERMINAL, GroupStatus, TaskStatus
from heteroflow.core.volumes import Volume
from heteroflow.db.tables import Event, InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.schemas.routing import DEFAULT_ALGORITHM, hash_key
from heteroflow.schemas.task_groups import (
    TaskGroupCreate,
    TaskGroupCreated,
    TaskGroupPatch,
    TaskGroupRead,
    TaskRead,
)
from heteroflow.services.identity.access import group_clause, visible_group, visible_task
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle.recovery import RUNNING, STOPPED, replace
from heteroflow.services.lifecycle.transitions import refresh_group_status, transition
from heteroflow.services.placement import dedup  # issue 16 (dedup)
from heteroflow.services.placement.fleet import read_fleet
from heteroflow.services.placement.planning import (
    GroupPlan,
    check_endpoint_name,
    check_quota,
    endpoint_taken,
    plan_group,
)
from heteroflow.services.tenancy.quotas import lock_tenant  # issue 16 (N2)
from heteroflow.services.unique import taken_as
from heteroflow.services.views import group_read, task_read


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
    # issue 16 (L2-L4): a live service of the same model and image is reused instead
    found = dedup.decide(s, clock, who, plan, offline_after_s=offline_after_s)
    if found.group is not None:
        with taken_as(s, endpoint_taken(plan)):  # the caller's own endpoint on it
            reused = dedup.reuse(s, clock, who, plan, found, offline_after_s=offline_after_s)
        if reused is not None:
            return reused
    plan.warnings.extend(found.warnings)
    lock_tenant(s, who.tenant_id)  # issue 16 (N2): one tenant's creates in turn
    check_endpoint_name(s, who, plan)  # again under the lock: a winner that just committed
    check_quota(s, who, plan)
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
        min_replicas=plan.min_replicas,  # issue 14 (A1), checked by plan_group
        max_replicas=plan.max_replicas,
        enable_api=plan.enable_api,
        endpoint_id=None,
        inference_templates=list(plan.templates),
        current_generation=1,
        idle_timeout_minutes=req.idle_timeout_minutes,
        desired=RUNNING,
        run_timeout_seconds=req.run_timeout_seconds,
        gpu_memory_utilization=req.gpu_memory_utilization,
        priority=req.priority,
        priority_class=req.priority_class,
        health_check=plan.health,
        scale_policy=plan.scale_policy,  # issue 14 (I1)
        schedule_window={},
        labels=dict(req.labels),
        status=GroupStatus.PENDING.value,
        status_message="",
        created_at=now,
        updated_at=now,
    )
    if req.schedule_window is not None:  # K1: plan_group checked it against the group
        group.schedule_window = req.schedule_window.stored()
    s.add(group)
    s.flush()
    tasks = [
        Task(
            id=new_id("task"),
            group_id=group.id,
            tenant_id=who.tenant_id,
            created_by=group.created_by,
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
            ports=ports_to_dicts(plan.task_ports(rank)),  # G1: a gang's rank 0: + rendezvous
            estimated_gpu_memory_mb=plan.estimated_gpu_memory_mb,
            estimate_detail=plan.estimate.detail if plan.estimate else "",
            memory_mb=plan.memory_mb,
            kv_offload_gb=spec.kv_offload_gb,
            volumes=[Volume.of(v).to_json() for v in spec.volumes],  # A2, checked by the plan
            preemptible=spec.preemptible,
            max_loras=spec.max_loras,  # LoRA slots (core.lora), checked by the plan
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

    # the route and the endpoint in the same unit of work as the group: a failure
    # leaves nothing (before issue 26 each had a savepoint, and a lost name race left a
    # group without its endpoint and key)
    s.add(
        ModelRoute(
            id=new_id("mr"), tenant_id=who.tenant_id, group_id=group.id,
            model_name=model_name, priority=0, weight=100, version="v1", active=True,
            algorithm=DEFAULT_ALGORITHM, created_at=now, updated_at=now,
        )
    )
    api_key: str | None = None
    if plan.enable_api:
        api_key = new_api_key()
        endpoint = InferenceEndpoint(
            id=new_id("ep"), tenant_id=who.tenant_id, group_id=group.id,
            name=plan.endpoint_name, port=plan.endpoint_port,
            external_port=req.external_port, key_hash=hash_key(api_key),
            key_prefix=key_display_prefix(api_key), created_by=who.user_id,
            created_at=now, updated_at=now,
        )
        with taken_as(s, endpoint_taken(plan)):  # a concurrent create took the name
            s.add(endpoint)
        group.endpoint_id = endpoint.id
    s.flush()
    read = group_read(group, tasks)
    return TaskGroupCreated(**read.model_dump(), api_key=api_key, warnings=list(plan.warnings))


def _tasks_of(s: Session, group_ids: list[str]) -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {g: [] for g in group_ids}
    if group_ids:
        for t in s.scalars(select(Task).where(Task.group_id.in_(group_ids))):
            out[t.group_id].append(t)
    return out


def list_groups(s: Session, who: Principal) -> list[TaskGroupRead]:
    q = (
        select(TaskGroup)
        .where(TaskGroup.deleted_at.is_(None), group_clause(who))
        .order_by(TaskGroup.created_at)
    )
    groups = list(s.scalars(q))
    tasks = _tasks_of(s, [g.id for g in groups])
    return [group_read(g, tasks[g.id]) for g in groups]


def get_group(s: Session, who: Principal, group_id: str) -> TaskGroupRead:
    g = visible_group(s, who, group_id)
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
                      TaskStatus.COMPLETED, TaskStatus.SLEEPING):
            # asleep: no engine runs; its agent removes a kept container once unlisted
            to = TaskStatus.STOPPED
        elif status in (TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.WAKING):
            to = TaskStatus.STOPPING
        else:
            return  # already stopping or stopped
        if transition(s, clock, task.id, status, to, reason):
            return
    raise Conflict(f"task {task.id} kept changing state; retry")


def ask_stop(s: Session, clock: Clock, task: Task, reason: str) -> None:
    """``_stop`` for other services (issue 14: a rollout retires replicas through it)."""
    _stop(s, clock, task, reason)


def delete_group(s: Session, who: Principal, clock: Clock, group_id: str) -> None:
    g = visible_group(s, who, group_id)
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
    visible_group(s, who, group_id)
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


# ---- the whole group: stop, start (issue 13), change what may change alone (D4) ----

# a current task in one of these has ended (or is ending): a start replaces it
_NOT_LIVE = frozenset({*TERMINAL, TaskStatus.STOPPING})


def _current(s: Session, group_id: str) -> list[Task]:
    return list(
        s.scalars(
            select(Task)
            .where(Task.group_id == group_id, Task.replaced_by == "")
            .order_by(Task.rank, Task.created_at)
            .execution_options(populate_existing=True)
        )
    )


def _fresh(s: Session, who: Principal, group_id: str) -> TaskGroupRead:
    """The group as written: its tasks moved by compare-and-set, behind the ORM's back."""
    s.flush()
    s.expire_all()
    return get_group(s, who, group_id)


def _desired_event(s: Session, clock: Clock, g: TaskGroup, old: str, message: str) -> None:
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=EventKind.DESIRED.value, from_status=old,
            to_status=g.desired, message=message, created_at=clock.now(),
        )
    )


def stop_group(s: Session, who: Principal, clock: Clock, group_id: str) -> TaskGroupRead:
    """The owner stops the service: ``desired`` stopped, every current task to stopping
    (engine up) or stopped, through the state door. Idempotent."""
    g = visible_group(s, who, group_id)
    stop_group_row(s, clock, g, f"stopped by {who.username}")
    return _fresh(s, who, g.id)


def stop_group_row(s: Session, clock: Clock, g: TaskGroup, why: str) -> None:
    """Stop ``g`` saying ``why``: the owner's stop above, and a schedule window's
    ``stop`` (K1, services/lifecycle/windows.py: the platform acting on its owner's rule)."""
    old, g.desired, g.updated_at = g.desired, STOPPED, clock.now()
    s.flush()  # before any task moves: the recovery loop reads it
    for t in _current(s, g.id):
        _stop(s, clock, t, why)
    if old != STOPPED:
        _desired_event(s, clock, g, old, why)
    refresh_group_status(s, clock, g.id, why)


def start_group(s: Session, who: Principal, clock: Clock, group_id: str) -> TaskGroupRead:
    """The owner starts the service (again): ``desired`` running, and every rank whose
    current task ended (stopped, failed, completed) or is stopping gets a fresh pending
    task with ``rebuild_count`` 0 — the recovery loop's cap starts over. 409 when it is
    meant to run and every rank already has a live task; a deleted group is not found."""
    g = visible_group(s, who, group_id)
    current = _current(s, g.id)
    ended = [t for t in current if TaskStatus(t.status) in _NOT_LIVE]
    if g.desired == RUNNING and not ended:
        raise Conflict(
            f"task group {g.id} is already running (status {g.status}); stop it first, "
            "or use restart"
        )
    why = f"started by {who.username}"
    old, g.desired, g.updated_at = g.desired, RUNNING, clock.now()
    s.flush()
    queued = 0
    for t in ended:
        new = replace(
            s, clock, t, TaskStatus(t.status), count=0, health_check=dict(g.health_check),
            message=f"{why} (replaces {t.id}); waiting for the scheduler",
        )
        queued += new is not None
    _desired_event(s, clock, g, old, f"{why}; {queued} task(s) queued")
    refresh_group_status(s, clock, g.id, why)
    return _fresh(s, who, g.id)


def _patched_health(g: TaskGroup, current: list[Task], req: TaskGroupPatch) -> dict[str, Any]:
    """The new health check, its port defaulting to the first container port and checked
    against them (as create does)."""
    assert req.health_check is not None
    health = req.health_check.model_dump()
    ports = [p.container_port for p in ports_from_dicts(current[0].ports)] if current else []
    if health["port"] is None:
        health["port"] = ports[0] if ports else g.health_check.get("port")
    elif ports and health["port"] not in ports:
        raise ValidationFailed(
            f"health_check.port {health['port']} is not a container port {ports}",
            field="health_check.port",
        )
    return health


def patch_group(
    s: Session, who: Principal, clock: Clock, group_id: str, req: TaskGroupPatch
) -> TaskGroupRead:
    """D4: change the health check and / or the idle timeout alone: no generation bump,
    no new task. The tasks' health check is updated with the group's, so every agent
    gets it in its next heartbeat's assignments."""
    g = visible_group(s, who, group_id)
    if req.health_check is None and req.idle_timeout_minutes is None:
        raise ValidationFailed(
            "nothing to change: give health_check and / or idle_timeout_minutes",
            field="health_check",
        )
    said: list[str] = []
    if req.health_check is not None:
        current = _current(s, g.id)
        health = _patched_health(g, current, req)
        g.health_check = health
        for t in current:
            t.health_check = dict(health)
            t.updated_at = clock.now()
        where = f"{health['path']} " if health["type"] == "http" else ""
        said.append(
            f"health check {health['type']} {where}on port {health['port']} every "
            f"{health['interval_seconds']:g} s, unhealthy after "
            f"{health['unhealthy_threshold']} failures"
        )
    if req.idle_timeout_minutes is not None:
        g.idle_timeout_minutes = req.idle_timeout_minutes
        said.append(f"idle timeout {req.idle_timeout_minutes} min (0 = never)")
    g.updated_at = clock.now()
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=EventKind.CONFIG_CHANGED.value,
            message=f"changed by {who.username}: " + "; ".join(said), created_at=clock.now(),
        )
    )
    return _fresh(s, who, g.id)
