"""``POST /api/v1/task-groups?dry_run=true``: the plan of a create, with nothing written.

The same validation as a create (``plan_group``), then for each task: the placement
a scheduler round would choose now, by the round's own calls (``Placer.preview``), or
the pending reason it would write, and the container the agent would
build — the one recipe (``core.recipe.container_plan``) the agent launches, with
placeholder ids, the placement's cards and the node's reported address — or, on a node
whose runtime is ``process``, the argv its agent starts (``core.process_recipe``, the
agent's own function).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import DEFAULT_ENV_ALLOW, ContainerPlan
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.core.engines.commands import CommandError
from heteroflow.core.engines.selection import NoEngineAvailable, select_engine
from heteroflow.core.gang import GangPlace, Stage, gang_places
from heteroflow.core.placement import NodeView, Placement, Policy, Reservation
from heteroflow.core.placement.scoring import cached_on, download_estimate_s
from heteroflow.core.ports import host_ports, with_host_ports
from heteroflow.core.process_recipe import ProcessNode, process_env, process_launch
from heteroflow.core.recipe import (
    NodeShape,
    RecipeResult,
    TaskShape,
    container_plan,
    image_tag_version,
)
from heteroflow.schemas.task_groups import (
    ContainerPlanRead,
    DryRunPlan,
    ModelSourceRead,
    PlannedTask,
    TaskGroupCreate,
)
from heteroflow.services.identity.auth import Principal
from heteroflow.services.placement import dedup, model_files  # issue 16 (dedup)
from heteroflow.services.placement.fleet import engines_of, read_fleet
from heteroflow.services.placement.placer import Intent, Outcome, Placer
from heteroflow.services.placement.planning import GroupPlan, check_quota, plan_group

# What a create assigns, and what only the agent knows, shown as placeholders.
PLANNED_ID = "task-<assigned-at-create>"
PLANNED_GROUP_ID = "tg-<assigned-at-create>"
PLANNED_CONFIG_DIR = "<agent-work-dir>/config"
UNPLACED_ADDRESS = "<node-address>"  # no placement: no node to publish on yet


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
    model_source: ModelSourceRead | None = None,
) -> DryRunPlan:
    """What a create would do, written nowhere: the plan and where each task would go
    now — the scheduler's own decision (``services.placer``: its index, ranked order,
    sampling, engine chain, preemption; a pipeline group all or nothing), on the one read
    of the fleet the plan was made on. Nothing is booked: the views are this call's."""
    fleet = read_fleet(s, clock, offline_after_s)  # the create's read, the round's too
    plan = plan_group(s, who, req, fleet, reservation, env_allow)
    # issue 16 (L2): the create's own dedup decision; a reuse places nothing
    found = dedup.decide(s, clock, who, plan, offline_after_s=offline_after_s)
    plan.warnings.extend(found.warnings)
    if found.group is None:
        check_quota(s, who, plan)  # issue 16 (N2): the create's own question
    share_key = fleet.share_key(who.tenant_id)
    demands = [
        plan.demand(share_key, task_id=f"planned-{rank}", tenant_id=who.tenant_id, rank=rank)
        for rank in range(0 if found.group is not None else plan.replicas)
    ]
    # the round's own calls on the round's own index, order and sampling (issue 27)
    placer = Placer(fleet, reservation, port_pool, policy or Policy())
    intent = Intent(image=plan.req.task.image, named=bool(plan.engine or plan.req.task.command))
    outcomes = placer.preview(demands, intent, gang=plan.req.parallelism == "pipeline")
    places = planned_gang(plan, outcomes)
    tasks = [_planned(plan, rank, o, places[rank]) for rank, o in enumerate(outcomes)]
    est = plan.estimate
    return DryRunPlan(
        name=req.name,
        model_name=plan.model_name,
        task_type=plan.task_type,
        parallelism=plan.req.parallelism,  # one-click: as the create writes it
        engine=plan.engine,
        engine_reason=plan.engine_reason,
        image=plan.req.task.image,
        estimated_gpu_memory_mb=plan.estimated_gpu_memory_mb,
        memory_mb=plan.memory_mb,
        estimate_detail=est.detail if est else None,
        tasks=tasks,
        warnings=plan.warnings,
        dedup=found.preview(plan.model_name),
        model_source=with_copies(model_source, fleet.nodes, policy or Policy()),
    )


def planned_gang(plan: GroupPlan, outcomes: Sequence[Outcome]) -> list[GangPlace | None]:
    """Each task's place in its gang (G1, ``core.gang``), as each stage's agent gets it
    at its claim: rank 0's node address and booked rendezvous port once the whole gang
    is placed; the placeholder address and port 0 while it is not (all or nothing). None
    for every task of a group that is not a gang."""
    if plan.req.parallelism != "pipeline":
        return [None] * len(outcomes)
    stages = [
        Stage(rank, o.node.address, with_host_ports(plan.task_ports(rank), o.placement.host_ports))
        for rank, o in enumerate(outcomes)
        if o.placement is not None and o.node is not None
    ]
    if outcomes and len(stages) == len(outcomes):
        return list(gang_places(stages))
    n = len(outcomes)
    return [GangPlace(rank, n, UNPLACED_ADDRESS, 0) for rank in range(n)]


def _planned(
    plan: GroupPlan, rank: int, o: Outcome, gang: GangPlace | None = None
) -> PlannedTask:
    p, node = o.placement, o.node
    where = None
    if p is not None and node is not None:
        where = {
            "node_id": node.id,
            "node_name": node.name,
            "gpu_ids": list(p.gpu_ids),
            "host_ports": list(p.host_ports),
        }
    address = node.address if node is not None else None
    engine = o.choice.engine if o.choice is not None else ""
    try:
        if node is not None and p is not None and node.runtime == "process":
            container = planned_process(plan, rank, p, node, engine=engine, gang=gang)
        else:
            container = plan_read(
                planned_recipe(plan, rank, p, node, address, engine=engine, gang=gang)
            )
        error = None
    except (ValueError, NoEngineAvailable) as exc:  # CommandError is a ValueError
        container, error = None, str(exc)
    return PlannedTask(
        rank=rank,
        gpu_required=plan.gpus_per_task,
        placement=where,
        pending_reason=o.reason or None,
        container=container,
        command_error=error,
    )


def planned_recipe(
    plan: GroupPlan,
    rank: int,
    placement: Placement | None,
    node: NodeView | None,
    address: str | None,
    *,
    engine: str = "",
    gang: GangPlace | None = None,
) -> RecipeResult:
    """The container the agent would build for task ``rank`` of ``plan`` on ``node``: the
    one recipe (``core.recipe``) with placeholder ids and the agent's inputs as far as
    the server knows them (the image's vLLM version from its tag, for kv offload; the
    node's engine chain for a task that names no engine, as the round picks it, H1;
    ``engine``: the one the placement chose there, when the caller has it; ``gang``: the
    stage's place in its gang, ``planned_gang``)."""
    spec = plan.req.task
    engine = engine or plan.engine
    if not engine and not spec.command and node is not None:
        chain = engines_of(node)
        engine = select_engine(explicit="", label="", image=spec.image, node=chain).engine
    # a name is looked up under DATA_MODELS inside the container, not read here
    task = _task_shape(plan, rank, placement, engine, gang)
    where = NodeShape(
        address=address or UNPLACED_ADDRESS,
        card_vendors={c.index: c.vendor for c in node.cards} if node else {},
    )
    return container_plan(task, where, work_dir_config=PLANNED_CONFIG_DIR)


def _task_shape(
    plan: GroupPlan,
    rank: int,
    placement: Placement | None,
    engine: str,
    gang: GangPlace | None = None,
    node: NodeView | None = None,
) -> TaskShape:
    """Task ``rank`` of ``plan`` as the create will write it (placeholder ids)."""
    spec = plan.req.task
    ports = plan.task_ports(rank)
    chosen = placement.host_ports if placement else host_ports(ports)
    # the chat template its GGUF needs, as the agent adds it (issue 33), where the
    # server can read the file as that node finds it
    template = model_files.template_args(spec, engine, [node] if node is not None else [])
    return TaskShape.of(
        spec,  # its image, model path, command, engine args, env and kv offload
        engine_args=(*spec.engine_args, *template),
        id=PLANNED_ID,
        group_id=PLANNED_GROUP_ID,
        name=spec.name or f"{plan.req.name}-{rank}",
        engine=engine,
        model_name=plan.model_name,
        ports=with_host_ports(ports, chosen),
        parallelism=plan.req.parallelism,
        gpu_required=plan.gpus_per_task,
        gpu_ids=tuple(placement.gpu_ids) if placement else (),
        gpu_memory_utilization=plan.req.gpu_memory_utilization,
        engine_version=image_tag_version(spec.image) if spec.kv_offload_gb else "",
        generation=1,
        task_type=plan.task_type,
        gang=gang,
    )


def planned_process(
    plan: GroupPlan,
    rank: int,
    placement: Placement,
    node: NodeView,
    *,
    engine: str = "",
    gang: GangPlace | None = None,
) -> ContainerPlanRead:
    """What the process runtime of ``node`` would start for task ``rank``: the agent's own
    recipe (``core.process_recipe.process_launch``, ``runtime`` "process"), with the
    placeholders of ``ProcessNode`` for what only the node knows (its Pythons; its
    ``cpu_threads``, 0 by default, which would add ``-t N``) and a model name not given as
    a path shown as the node looks it up. No container: no mounts, cards or security
    options; the image is only recorded."""
    spec = plan.req.task
    if spec.command:  # the scheduler never places one here; the agent refuses it too
        raise CommandError("the process runtime never runs a custom task.command")
    engine = engine or plan.engine
    if not engine:  # the round's chain on this node (H1)
        chain = engines_of(node)
        engine = select_engine(explicit="", label="", image=spec.image, node=chain).engine
    task = _task_shape(plan, rank, placement, engine, gang, node)
    found = model_files.model_here(spec.model_path, [node])  # as its agent finds a name
    model = spec.model_path if spec.model_path.startswith("/") else (
        str(found) if found is not None else f"<{spec.model_path} under the node's model folders>"
    )
    port = task.ports[0].host_port if task.ports else 0
    cmd = process_launch(task, model=model, port=port, node=ProcessNode(address=node.address))
    return ContainerPlanRead(
        name=task.id,
        image=task.image,
        entrypoint=None,
        command=list(cmd.args),
        env=process_env(task, cmd),
        ports=[
            {"container_port": p.container_port, "host_ip": ENGINE_ADDRESS,
             "host_port": p.host_port}
            for p in task.ports[:1]
        ],
        mounts=[],
        ipc_mode=None,
        shm_size=None,
        network_mode=None,
        gpu=None,
        labels={},
        runtime="process",
    )


def plan_read(result: RecipeResult | ContainerPlan) -> ContainerPlanRead:
    """A container plan as the dry run shows it (config files by target, not content)."""
    if isinstance(result, RecipeResult):
        c, targets = result.plan, [f.target for f in result.config_files]
    else:
        c, targets = result, []
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
        labels=dict(c.labels),
        security=asdict(c.security),
        config_files=targets,
    )


def with_copies(
    source: ModelSourceRead | None, nodes: list[NodeView], policy: Policy
) -> ModelSourceRead | None:
    """Issue 29: the resolved source (``services.placement.sources``) with the nodes whose
    cache holds it at the resolved revision, and the download a start elsewhere adds."""
    if source is None:
        return None
    if source.kind == "fleet":  # resolved from the holders' reports: their copy's size
        copies = [c for n in nodes for c in n.cached_models
                  if c.complete and c.fleet == source.source]
        if copies:
            source = source.model_copy(update={
                "resolved": True, "revision": copies[0].revision,
                "bytes": max(c.bytes for c in copies),
            })
    return source.model_copy(update={
        "cached_on": cached_on(nodes, source.source, source.revision),
        "download_s": download_estimate_s(source.bytes or 0, policy.download_mb_s),
    })
