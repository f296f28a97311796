"""``POST /api/v1/task-groups?dry_run=true``: the plan of a create, with nothing written.

The same validation as a create (``plan_group``), then for each task: the placement
the scheduler would choose now (or why it can't), and the container the agent would
build — engine argv from the command builders, environment, mounts, GPU arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import (
    DEFAULT_ENV_ALLOW,
    ContainerPlan,
    container_env,
    gpu_request,
    model_mount,
    shared_memory,
)
from heteroflow.core.engines.commands import CommandError, LaunchShape, build_command
from heteroflow.core.placement import NodeView, Placement, Policy, Reservation, book, place
from heteroflow.schemas.task_groups import (
    ContainerPlanRead,
    DryRunPlan,
    PlannedTask,
    TaskGroupCreate,
)
from heteroflow.services.auth import Principal
from heteroflow.services.planning import GroupPlan, plan_group
from heteroflow.services.scheduling import node_views
from heteroflow.services.sharing import tenant_share_keys

PLANNED_ID = "task-<assigned-at-create>"


def dry_run(
    s: Session,
    who: Principal,
    clock: Clock,
    req: TaskGroupCreate,
    *,
    offline_after_s: float,
    reservation: Reservation,
    port_pool: range,
    policy: Policy | None = None,
    env_allow: Sequence[str] = DEFAULT_ENV_ALLOW,
) -> DryRunPlan:
    """What a create would do, written nowhere: the plan and where each task would go
    now, by the same filters, sharing rules and scorers as a scheduler round (a pipeline
    group is shown stage by stage; the round places it all-or-nothing)."""
    policy = policy or Policy()
    keys = tenant_share_keys(s)
    views = node_views(s, clock, offline_after_s, keys)
    plan = plan_group(s, who, req, list(views.values()), reservation, env_allow)
    share_key = keys.get(who.tenant_id, who.tenant_id)
    tasks: list[PlannedTask] = []
    for rank in range(plan.replicas):
        demand = plan.demand(share_key, task_id=f"planned-{rank}", tenant_id=who.tenant_id)
        decision = place(demand, list(views.values()), reservation, port_pool, policy)
        if isinstance(decision, Placement):
            node = views[decision.node_id]
            book(node, decision, demand)
            tasks.append(_planned(plan, rank, decision, node))
        else:
            tasks.append(_planned(plan, rank, None, None, decision.reason))
    est = plan.estimate
    return DryRunPlan(
        name=req.name,
        model_name=plan.model_name,
        task_type=plan.task_type,
        parallelism=req.parallelism,
        engine=plan.engine,
        engine_reason=plan.engine_reason,
        image=req.task.image,
        estimated_gpu_memory_mb=plan.estimated_gpu_memory_mb,
        memory_mb=plan.memory_mb,
        estimate_detail=est.detail if est else None,
        tasks=tasks,
        warnings=plan.warnings,
    )


def _planned(
    plan: GroupPlan,
    rank: int,
    placement: Placement | None,
    node: NodeView | None,
    reason: str | None = None,
) -> PlannedTask:
    host_ports = placement.host_ports if placement else tuple(p["host_port"] for p in plan.ports)
    where = None
    if placement is not None and node is not None:
        where = {
            "node_id": node.id,
            "node_name": node.name,
            "gpu_ids": list(placement.gpu_ids),
            "host_ports": list(placement.host_ports),
        }
    try:
        container = _container(plan, rank, placement, node, host_ports)
        error = None
    except (CommandError, ValueError) as exc:
        container, error = None, str(exc)
    return PlannedTask(
        rank=rank,
        gpu_required=plan.gpus_per_task,
        placement=where,
        pending_reason=reason,
        container=container,
        command_error=error,
    )


def _container(
    plan: GroupPlan,
    rank: int,
    placement: Placement | None,
    node: NodeView | None,
    host_ports: tuple[int, ...],
) -> ContainerPlanRead:
    spec = plan.req.task
    gpu_ids = list(placement.gpu_ids) if placement else []
    vendor = ""
    if node is not None and gpu_ids:
        vendor = next((c.vendor for c in node.cards if c.index == gpu_ids[0]), "")
    gpu = gpu_request(vendor, gpu_ids) if vendor else None
    mount, engine_path = model_mount(spec.model_path, plan.engine)
    if spec.command or not plan.engine:
        entrypoint, args, engine_env = None, tuple(spec.command), {}
    else:
        cmd = build_command(
            LaunchShape(
                engine=plan.engine,
                model_path=engine_path,
                served_model_name=plan.model_name,
                port=plan.ports[0]["container_port"],
                parallelism=plan.req.parallelism,
                gpus=plan.gpus_per_task,
                tensor_parallel_size=plan.gpus_per_task
                if plan.req.parallelism == "tensor_parallel"
                else 1,
                gpu_memory_utilization=plan.req.gpu_memory_utilization,
                extra_args=tuple(spec.engine_args),
                kv_offload_gb=spec.kv_offload_gb,
            )
        )
        entrypoint, args, engine_env = cmd.entrypoint, cmd.args, dict(cmd.env)
    ipc, shm, network = shared_memory(plan.req.parallelism, plan.gpus_per_task)
    name = f"{plan.req.name}-{rank}"
    c = ContainerPlan(
        name=PLANNED_ID,
        image=spec.image,
        entrypoint=entrypoint,
        command=tuple(args),
        env=container_env(
            spec.env,
            task_id=PLANNED_ID,
            group_id="tg-<assigned-at-create>",
            task_name=spec.name or name,
            engine=plan.engine,
            engine_env=engine_env,
            gpu=gpu,
        ),
        ports={
            p["container_port"]: ("127.0.0.1", hp)
            for p, hp in zip(plan.ports, host_ports, strict=True)
        },
        mounts=(mount,) if mount else (),
        ipc_mode=ipc,
        shm_size=shm,
        network_mode=network,
        gpu=gpu,
        labels={},
    )
    return ContainerPlanRead(
        name=c.name,
        image=c.image,
        entrypoint=list(c.entrypoint) if c.entrypoint else None,
        command=list(c.command),
        env=dict(c.env),
        ports=[
            {"container_port": cp, "host_ip": ip, "host_port": hp}
            for cp, (ip, hp) in c.ports.items()
        ],
        mounts=[asdict(m) for m in c.mounts],
        ipc_mode=c.ipc_mode,
        shm_size=c.shm_size,
        network_mode=c.network_mode,
        gpu=asdict(c.gpu) | {"env": dict(c.gpu.env)} if c.gpu else None,
    )
