"""Validating a task-group request into a plan, shared by create and dry run.

``plan_group`` checks every rule that needs no write (priority ceiling, the model path
against the nodes' volume rules, engine, shape, ports, health check, kv offload, the
group's run timeout, replica bounds, scale policy and schedule window, endpoint-name
clash, the create-time memory precheck) and returns the derived values;
``check_task`` is its part about one task's intent, which an update (services/lifecycle/rollout.py)
asks of its new generation too — the same rule, so an update that cannot run is refused
at the request as its create would be (issue 26);
``check_quota`` asks the tenant's quotas about the plan (when dedup reuses nothing);
``create_group`` writes them and ``dry_run`` shows them. Both plan on the one read
model of the fleet (``services.fleet.read_fleet``, online by ``node_offline_after_s``):
the nodes' engines, volume rules and cards are read there, never here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.autoscale import ScalePolicy, create_bounds
from heteroflow.core.containers import (
    DEFAULT_ENV_ALLOW,
    env_problem,
    needs_container,
    process_runs,
)
from heteroflow.core.engines import (
    CPU_CAPABLE,
    ENGINES,
    LLAMACPP_AGENT_FLAGS,
    owned_flag_in,
    resolve_engine,
)
from heteroflow.core.engines.registry import vendors_of
from heteroflow.core.errors import Conflict, ValidationFailed
from heteroflow.core.estimate import MemoryEstimate
from heteroflow.core.gang import stage_ports
from heteroflow.core.lora import lora_refusal
from heteroflow.core.paths import VolumeRule, model_path_refusal
from heteroflow.core.placement import NodeView, Reservation, TaskDemand, never_fits
from heteroflow.core.ports import PortMapping, host_ports
from heteroflow.core.quotas import new_service, task_usage
from heteroflow.core.volumes import volumes_of, volumes_refusal
from heteroflow.db.tables import InferenceEndpoint, Tenant
from heteroflow.schemas.task_groups import HealthCheckIn, TaskGroupCreate, TaskSpec
from heteroflow.schemas.windows import check_for_group
from heteroflow.services.identity.auth import Principal
from heteroflow.services.placement import model_files
from heteroflow.services.placement.fleet import Fleet
from heteroflow.services.placement.one_click import one_click
from heteroflow.services.placement.sources import check_fleet_copy
from heteroflow.services.serving.adapters import check_not_an_adapter
from heteroflow.services.tenancy import quotas

DEFAULT_CONTAINER_PORT = 8000
KV_OFFLOAD_ENGINES = frozenset({"vllm"})
# engines whose stages the platform wires into an inference gang (issue 32 item 3): vLLM's
# multi-node MP executor (no Ray). SGLang's flags are built but never run here.
PIPELINE_SERVING = ("vllm",)


@dataclass
class GroupPlan:
    req: TaskGroupCreate
    engine: str
    engine_reason: str
    task_type: str
    enable_api: bool
    model_name: str
    ports: tuple[PortMapping, ...]
    replicas: int
    gpus_per_task: int
    endpoint_name: str
    endpoint_port: int
    health: dict[str, Any]
    memory_mb: int
    estimated_gpu_memory_mb: int
    estimate: MemoryEstimate | None = None
    templates: list[dict[str, str]] = field(default_factory=list)  # one-click chain (E3)
    warnings: list[str] = field(default_factory=list)
    # issue 14 (A1, I1): the replica bounds and scale policy the group is written with
    min_replicas: int = 0
    max_replicas: int = 0
    scale_policy: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        if self.req.parallelism in ("split", "pipeline"):
            return self.req.world_size
        # ranks, not cards: a CPU service (0 GPUs) is one rank, as it was asked
        return self.replicas * max(1, self.gpus_per_task)

    def task_ports(self, rank: int) -> tuple[PortMapping, ...]:
        """Task ``rank``'s ports as the create writes them: a gang's rank 0 books one more
        host port, its rendezvous (``core.gang``, G1)."""
        if self.req.parallelism == "pipeline":
            return stage_ports(self.ports, rank)
        return self.ports

    def demand(
        self, share_key: str = "", task_id: str = "", tenant_id: str = "", rank: int = 0
    ) -> TaskDemand:
        """What task ``rank`` of the group asks the scheduler for (as a round would see it)."""
        return TaskDemand(
            task_id=task_id,
            gpu_required=self.gpus_per_task,
            gpu_type=self.req.task.gpu_type,
            gpu_memory_utilization=self.req.gpu_memory_utilization,
            estimated_gpu_memory_mb=self.estimated_gpu_memory_mb,
            memory_mb=self.memory_mb,
            host_ports=host_ports(self.task_ports(rank)),
            task_type=self.task_type,
            model_path=self.req.task.model_path,
            engine=self.engine,
            share_key=share_key,
            tenant_id=tenant_id,
            priority=self.req.priority,
            multi_node=self.req.parallelism == "pipeline",
            engine_vendors=vendors_of(self.engine),
            priority_class=self.req.priority_class,
            needs_container=needs_container(self.req.task.command, self.engine),
            host_paths=tuple(v.host_path for v in self.req.task.volumes),
            preemptible=self.req.task.preemptible,
        )


def infer_task_type(req: TaskGroupCreate, engine: str) -> str:
    """Explicit wins; else inference when model_path, enable_api or an engine image says so."""
    if req.task_type:
        return req.task_type
    if req.task.model_path or req.enable_api or engine:
        return "inference"
    return "container"


def _replica_shape(req: TaskGroupCreate, task_type: str, engine: str) -> tuple[int, int]:
    """(number of tasks, GPUs per task) for the requested parallelism."""
    if req.parallelism == "pipeline":
        # G1: world_size stages, placed all-or-nothing across nodes. An inference gang
        # serves one model across nodes where the engine's stages are wired to the gang
        # (issue 32 item 3): vLLM's multi-node executor, rank 0 answering.
        if task_type == "inference" and engine not in PIPELINE_SERVING and not req.task.command:
            raise ValidationFailed(
                "parallelism 'pipeline' serves one model across nodes with "
                f"{' or '.join(PIPELINE_SERVING)} only (its multi-node executor: rank 0 "
                "serves the API, the other stages run headless); the engine is "
                f"{engine or 'not resolved (set task.engine to vllm)'}. For other engines "
                "use single, tensor_parallel or split",
                field="parallelism",
            )
        if req.world_size < 2:
            raise ValidationFailed("pipeline needs world_size >= 2 stages", field="world_size")
        return req.world_size, req.task.gpu_required
    if req.parallelism == "tensor_parallel":
        if req.world_size < 2:
            raise ValidationFailed("tensor_parallel needs world_size >= 2", field="world_size")
        return 1, req.world_size
    if req.parallelism == "split":
        return req.world_size, req.task.gpu_required
    return 1, req.task.gpu_required


def _check_cpu_stages(spec: TaskSpec, gpus: int) -> None:
    """vLLM 0.32's CPU build allocates a later stage's buffer for the activations it
    receives only in the warm-up run, which eager mode skips (``--enforce-eager``, and
    LoRA, which forces it): every stage starts, and the first request fails (``assert
    self.intermediate_tensors is not None``). Refused here rather than served broken."""
    if gpus:
        return
    if owned_flag_in(spec.engine_args, frozenset({"--enforce-eager"})):
        raise ValidationFailed(
            "engine_args: --enforce-eager breaks a pipeline on vLLM's CPU build (its eager "
            "mode skips the warm-up that sizes a later stage's activation buffer, so the "
            "first request fails); leave it out, or trace once with the eager backend: "
            '--compilation-config \'{"mode": 2, "backend": "eager"}\'',
            field="task.engine_args",
        )
    if spec.max_loras:
        raise ValidationFailed(
            "max_loras: LoRA puts vLLM's CPU build in eager mode, which breaks a pipeline "
            "(a later stage has no activation buffer at the first request)",
            field="task.max_loras",
        )


def _check_kv_offload(spec: TaskSpec, parallelism: str, engine: str, task_type: str) -> None:
    """C12, API side: vLLM inference only, no pipeline, no custom command."""
    if not spec.kv_offload_gb:
        return
    why = ""
    if task_type != "inference":
        why = f"it is for inference services, not {task_type}"
    elif parallelism == "pipeline":
        why = "pipeline parallelism does not support it"
    elif spec.command:
        why = "a custom command sets its own engine flags"
    elif engine not in KV_OFFLOAD_ENGINES:
        why = f"only vLLM supports it; the engine is {engine or 'not resolved (name it)'}"
    if why:
        raise ValidationFailed(f"kv_offload_gb: {why}", field="task.kv_offload_gb")


def _check_lora(spec: TaskSpec, engine: str, task_type: str) -> None:
    """LoRA slots (core.lora): an engine that loads adapters at runtime (the registry's
    ``runtime_lora``), an inference service, no custom command."""
    runtime_lora = engine in ENGINES and ENGINES[engine].runtime_lora
    why = lora_refusal(
        spec.max_loras, engine=engine, runtime_lora=runtime_lora, task_type=task_type,
        command=bool(spec.command),
    )
    if why:
        raise ValidationFailed(why, field="task.max_loras")


def _check_fields(spec: TaskSpec, parallelism: str, engine: str, task_type: str, gpus: int,
                  env_allow: Sequence[str], *, cpu_build: bool = False) -> None:
    if task_type == "inference" and not spec.model_path and not spec.command:
        raise ValidationFailed(
            "an inference service needs task.model_path (or a custom task.command); "
            "without it every engine fails to start",
            field="task.model_path",
        )
    if gpus == 0 and task_type == "inference" and engine not in CPU_CAPABLE and not cpu_build:
        raise ValidationFailed(
            f"gpu_required 0 runs on the CPU, which only {', '.join(sorted(CPU_CAPABLE))} "
            "can do (and vLLM where a node runs its CPU build: none you may use does); "
            f"engine is {engine or 'unresolved'}",
            field="task.gpu_required",
        )
    if engine in ENGINES and not spec.command and parallelism not in ENGINES[engine].shapes:
        # G2: the engine has no shape for it (MindIE, llama.cpp, TensorRT-LLM: no pipeline);
        # refused here for every task type, not later by the agent's command builder
        shapes = ", ".join(sorted(ENGINES[engine].shapes))
        raise ValidationFailed(
            f"engine {engine} does not support parallelism {parallelism!r}; use one of "
            f"{shapes}",
            field="parallelism",
        )
    if parallelism == "pipeline" and not spec.command and task_type != "inference":
        # issue 32 item 4: no engine builds a stage's command for a container or training
        # gang (vLLM's multi-node flags are an inference gang's): every stage would fail
        # at the agent
        raise ValidationFailed(
            f"a {task_type} pipeline group runs task.command in every stage (each stage "
            "gets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE to find the others, and "
            "listens on HETEROFLOW_STAGE_PORT); without one no stage's command can be built",
            field="task.command",
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
        problem = env_problem(item, env_allow)
        if problem:
            raise ValidationFailed(f"env[{i}]: {problem}", field=f"task.env[{i}]")
    _check_kv_offload(spec, parallelism, engine, task_type)
    _check_lora(spec, engine, task_type)


def _check_runs_somewhere(spec: TaskSpec, engine: str, nodes: list[NodeView]) -> None:
    """Work only a container runs (a custom command, an engine that exists only as an
    image: ``needs_container``, the scheduler's own test) is refused when every node the
    caller may use runs the process runtime — as the memory precheck refuses what no
    registered node could hold (issue 26). With no node registered nothing is refused;
    a Docker node counts while offline (it may come back)."""
    if not nodes or any(n.runtime != "process" for n in nodes):
        return
    if not needs_container(spec.command, engine) and any(
        process_runs(engine, n.engines) for n in nodes
    ):
        return  # e.g. vLLM where an agent reports it (HETEROFLOW_AGENT_VLLM_PYTHON)
    if spec.command:
        what, field_ = "a custom task.command", "task.command"
    elif engine:
        what, field_ = f"engine {engine}", "task.engine" if spec.engine else "task.image"
    else:
        what, field_ = f"image {spec.image!r}", "task.image"
    raise ValidationFailed(
        f"{what} needs a node with the Docker runtime, and every node you may use runs "
        "the process runtime, which starts only the platform's llama.cpp launcher and, "
        "where its agent has one, vLLM (never a custom command or another engine's image)",
        field=field_,
    )


def check_task(
    spec: TaskSpec,
    *,
    engine: str,
    task_type: str,
    parallelism: str,
    gpus: int,
    nodes: list[NodeView],
    env_allow: Sequence[str],
) -> None:
    """Every rule of one task's intent that needs no file and no write: the model path
    (C4, ``core.paths.model_path_refusal``, the agent's own first check), its volumes
    (A2, ``core.volumes.volumes_refusal``, the same rule), where it can run, the engine's
    shapes and flags, env, kv offload. A create and its dry run ask it of the request, an
    update of its new generation (issue 26); 400 naming ``task.*``.
    ``nodes``: those the caller may use (offline ones too)."""
    rules = [VolumeRule(n.allowed_volume_prefixes, n.denied_volume_prefixes) for n in nodes]
    problem = model_path_refusal(
        spec.model_path, engine=engine, custom_command=bool(spec.command), rules=rules,
    )
    if problem:
        raise ValidationFailed(problem, field="task.model_path")
    check_fleet_copy(spec.model_path, nodes)  # issue 29: fleet:// from the reports
    if spec.volumes and nodes and all(n.runtime == "process" for n in nodes):
        # as _check_runs_somewhere; the scheduler's node gate says NO_MOUNTS
        raise ValidationFailed(
            "task.volumes need a node with the Docker runtime, and every node you may use "
            "runs the process runtime, which mounts nothing",
            field="task.volumes",
        )
    refused = volumes_refusal(
        volumes_of(spec.volumes), model_path=spec.model_path, engine=engine, rules=rules
    )
    if refused:
        raise ValidationFailed(refused[0], field=refused[1])
    _check_runs_somewhere(spec, engine, nodes)
    # vLLM without cards: only where a node runs its CPU build (none registered: it waits)
    cpu_build = engine in ENGINES and ENGINES[engine].cpu_build and (
        not nodes or any(n.cpu_build(engine) for n in nodes)
    )
    _check_fields(spec, parallelism, engine, task_type, gpus, env_allow, cpu_build=cpu_build)


def _check_operator_only(req: TaskGroupCreate, who: Principal) -> None:
    """What reaches past a tenant's own work is an operator's decision (issue 10): a
    fixed host port (a member could take a port the platform or another tenant needs,
    or one below 1024), the host network of pipeline stages, and a priority that may
    preempt other tenants."""
    if who.is_operator:
        return
    for i, p in enumerate(req.task.ports):
        if p.host_port:
            raise ValidationFailed(
                f"ports[{i}].host_port {p.host_port}: fixed host ports are for platform "
                "operators; use 0 and the platform allocates one from its pool",
                field=f"task.ports[{i}].host_port",
            )
    if req.parallelism == "pipeline":
        raise ValidationFailed(
            "pipeline stages run on the host network of their nodes, which only a platform "
            "operator may grant; use single, tensor_parallel or split",
            field="parallelism",
        )
    if req.priority_class == "platform":
        raise ValidationFailed(
            "priority_class 'platform' (preempting other tenants' work) is set by platform "
            "operators; a member's priority ranks within its own tenant",
            field="priority_class",
        )


def _check_strict_type(gpu_type: str, nodes: list[NodeView]) -> None:
    """B7: pipeline stages that name a gpu_type take only that type; a type that no node
    the tenant may use has ever reported is refused now (one that is only offline waits
    in the queue). ``nodes``: the ones visible to the tenant."""
    if gpu_type and not any(c.model == gpu_type for n in nodes for c in n.cards):
        known = sorted({c.model for n in nodes for c in n.cards})
        raise ValidationFailed(
            f"no node you may use reports gpu_type {gpu_type!r} (known: "
            f"{', '.join(known) or 'none'}); pipeline stages never fall back to another type",
            field="task.gpu_type",
        )


def _health(req: TaskGroupCreate, container_ports: list[int]) -> dict[str, Any]:
    health = (req.health_check or HealthCheckIn()).model_dump()
    if health["port"] is None:
        health["port"] = container_ports[0]
    elif health["port"] not in container_ports:
        raise ValidationFailed(
            f"health_check.port {health['port']} is not a container port {container_ports}",
            field="health_check.port",
        )
    return health


def _check_priority(s: Session, who: Principal, priority: int) -> None:
    """B4: operators set any priority 0-1000; members up to their tenant's ceiling."""
    if who.is_operator:
        return
    ceiling = s.scalar(select(Tenant.priority_ceiling).where(Tenant.id == who.tenant_id))
    if ceiling is not None and priority > ceiling:
        raise ValidationFailed(
            f"priority {priority} is above your tenant's ceiling of {ceiling}; use 0-{ceiling} "
            "or ask a platform operator",
            field="priority",
        )


def plan_group(
    s: Session,
    who: Principal,
    req: TaskGroupCreate,
    fleet: Fleet,
    reservation: Reservation,
    env_allow: Sequence[str] = DEFAULT_ENV_ALLOW,
) -> GroupPlan:
    """The one validation path of a create and its dry run, on one read of the fleet."""
    _check_priority(s, who, req.priority)
    _check_operator_only(req, who)
    templates: list[dict[str, str]] = []
    nodes = [n for n in fleet.nodes if n.visible_to(who.tenant_id)]  # dedicated nodes (B7)
    if not req.task.image and not req.task.command:
        req, templates = one_click(req, nodes)
    spec = req.task
    engine, engine_reason = resolve_engine(
        spec.engine, req.labels.get("heteroflow.engine", ""), spec.image
    )
    if templates:
        engine_reason = f"one-click template: {templates[0]['reason']}"
    task_type = infer_task_type(req, engine)
    ports = tuple(PortMapping(p.container_port, p.host_port) for p in spec.ports) or (
        PortMapping(DEFAULT_CONTAINER_PORT),
    )
    container_ports = [p.container_port for p in ports]
    replicas, gpus = _replica_shape(req, task_type, engine)
    if task_type == "inference" and req.parallelism == "pipeline" and not spec.command:
        _check_cpu_stages(spec, gpus)
    # C4 among them, before anything reads the model (the memory estimate below)
    check_task(spec, engine=engine, task_type=task_type, parallelism=req.parallelism,
               gpus=gpus, nodes=nodes, env_allow=env_allow)
    if req.endpoint_port and not who.is_operator and req.endpoint_port not in container_ports:
        raise ValidationFailed(
            f"endpoint_port {req.endpoint_port} is not one of the group's container ports "
            f"{container_ports}",
            field="endpoint_port",
        )
    if req.parallelism == "pipeline":
        _check_strict_type(req.task.gpu_type, nodes)
    check_not_an_adapter(s, who.tenant_id, req.model_name or req.name)  # LoRA (core.lora)
    plan = GroupPlan(
        req=req,
        engine=engine,
        engine_reason=engine_reason,
        task_type=task_type,
        enable_api=req.enable_api or bool(spec.model_path),
        model_name=req.model_name or req.name,
        ports=ports,
        replicas=replicas,
        gpus_per_task=gpus,
        endpoint_name=req.endpoint_name or req.name,
        endpoint_port=req.endpoint_port or container_ports[0],
        health=_health(req, container_ports),
        memory_mb=spec.memory_mb,
        estimated_gpu_memory_mb=spec.estimated_gpu_memory_mb,
        templates=templates,
    )
    _check_group(plan)
    model_files.check_model_file(plan.req.task, plan.engine, nodes)
    _apply_estimate(plan, nodes, reservation)
    check_endpoint_name(s, who, plan)
    return plan


def _check_group(plan: GroupPlan) -> None:
    """The rules of the group as it will be written, on the plan's own task type and
    replica count (one-click may have made the group split): no run timeout for an
    inference service (A10; the schema refuses it when the type is given), the replica
    bounds and scale policy (A1, I1), the schedule window's rules that need the group
    (K1). A create once asked them as it wrote the group, after planning, so its dry
    run said yes to what the create then refused (issue 27); here both ask them."""
    req = plan.req
    if req.run_timeout_seconds and plan.task_type == "inference":
        raise ValidationFailed(
            "inference services are long-running and have no run timeout (A10); it is "
            "for training and container groups",
            field="run_timeout_seconds",
        )
    sp = req.scale_policy
    plan.min_replicas, plan.max_replicas = create_bounds(
        replicas=plan.replicas, task_type=plan.task_type, parallelism=req.parallelism,
        min_replicas=req.min_replicas if sp is None or sp.min_replicas is None
        else sp.min_replicas,
        max_replicas=req.max_replicas if sp is None or sp.max_replicas is None
        else sp.max_replicas,
    )
    if sp is not None and sp.metric is not None and sp.target is not None:
        plan.scale_policy = ScalePolicy(sp.enabled, sp.metric, sp.target).to_json()
    if req.schedule_window is not None:
        check_for_group(
            req.schedule_window, task_type=plan.task_type, parallelism=req.parallelism,
            min_replicas=plan.min_replicas, max_replicas=plan.max_replicas,
            current_replicas=plan.replicas,
        )


def check_endpoint_name(s: Session, who: Principal, plan: GroupPlan) -> None:
    """409 when the caller's tenant already has an endpoint of the plan's name.

    Planning asks it (a read); a create asks again under its tenant's lock, so a create
    of the name that committed meanwhile refuses this one before anything is written —
    fifty creates of one name at once wait for the lock one statement each, not one
    create each. The unique constraint holds what no lock orders (services/unique.py).
    """
    if not plan.enable_api:
        return
    clash = s.scalar(
        select(InferenceEndpoint.id).where(
            InferenceEndpoint.tenant_id == who.tenant_id,
            InferenceEndpoint.name == plan.endpoint_name,
        )
    )
    if clash is not None:
        raise endpoint_taken(plan)


def endpoint_taken(plan: GroupPlan) -> Conflict:
    """The 409 for a plan whose endpoint name the tenant already has: at planning (the
    read) and at the write (the database's unique constraint, when a concurrent create
    of the name committed in between; services/unique.py)."""
    if plan.req.endpoint_name:
        return Conflict(
            f"an endpoint named {plan.endpoint_name!r} already exists in this tenant: "
            "choose another endpoint_name",
            field="endpoint_name",
        )
    return Conflict(  # issue 33: the user named a service, so the message says service
        f"a service named {plan.endpoint_name!r} already exists in this tenant: choose "
        "another name (or give endpoint_name)",
        field="name",
    )


def check_quota(s: Session, who: Principal, plan: GroupPlan) -> None:
    """N2 (A6): the tenant's quotas hold the new service and its tasks as the scheduler
    will book them (409 naming the quota). A create asks it (under the tenant's lock)
    and its dry run asks the same, both after dedup: a reused service adds nothing."""
    per_task = task_usage(
        gpu_required=plan.gpus_per_task, task_type=plan.task_type,
        gpu_memory_utilization=plan.req.gpu_memory_utilization, memory_mb=plan.memory_mb,
    )
    quotas.require(
        s, who.tenant_id, new_service(per_task, plan.replicas),
        f"this service ({plan.replicas} replica(s))",
    )


def _apply_estimate(plan: GroupPlan, nodes: list[NodeView], reservation: Reservation) -> None:
    """B8: use the estimate for placement and refuse what no registered node could hold."""
    est = model_files.estimate(plan.req.task, plan.engine, nodes)
    plan.estimate = est
    if est is None:
        return
    if plan.gpus_per_task == 0:
        if not plan.memory_mb:
            plan.memory_mb = est.total_mb
    elif not plan.estimated_gpu_memory_mb:
        # tensor parallelism splits the weights and the KV cache across the cards
        plan.estimated_gpu_memory_mb = -(-est.total_mb // plan.gpus_per_task)
    reason = never_fits(plan.demand(), nodes, reservation)
    if reason:
        raise ValidationFailed(
            f"no registered node could ever hold this model: it needs {est.detail}; {reason}",
            field="task.model_path",
        )
