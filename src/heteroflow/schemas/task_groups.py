"""Wire schemas of task groups and tasks (create / read)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from heteroflow.core.autoscale import (  # issue 14 (scaling)
    MAX_REPLICAS,
    create_bounds,
    scalable_problem,
    target_problem,
)
from heteroflow.core.engines import ENGINES, resolve_engine
from heteroflow.core.errors import ValidationFailed  # issue 14 (scaling)
from heteroflow.core.lora import MAX_LORAS
from heteroflow.schemas.capabilities import CapabilitiesRead  # issue 15
from heteroflow.schemas.common import (
    NAME_PATTERN,
    Labels,
    NameStr,
    SafeStr,
    Strict,
    TextItem,
    no_nul,
)
from heteroflow.schemas.dedup import DedupRead  # issue 16 (dedup)
from heteroflow.schemas.windows import ScheduleWindowIn  # issue 14 (K1)

# What callers put in "model": no spaces or commas (engines read comma lists of aliases).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$"
ModelNameStr = Annotated[
    str, StringConstraints(max_length=256, pattern=MODEL_NAME_PATTERN), AfterValidator(no_nul)
]
# Docker's reference grammar: registry and repository lower case; a tag may hold capitals
# (Huawei's MindIE images are tagged like 2.2.RC1-800I-A2-py311).
IMAGE_PATTERN = (
    r"^[a-z0-9][a-z0-9._/:-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)


class PortMapping(Strict):
    container_port: int = Field(ge=1, le=65535)
    host_port: int = Field(default=0, ge=0, le=65535, description="0 = allocated from the pool")


class HealthCheckIn(Strict):
    type: Literal["http", "tcp"] = "http"
    path: SafeStr = Field(default="/health", max_length=1024, pattern=r"^/")
    port: int | None = Field(default=None, ge=1, le=65535, description="container port")
    interval_seconds: float = Field(default=10, gt=0, le=3600)
    timeout_seconds: float = Field(default=3, gt=0, le=600)
    unhealthy_threshold: int = Field(default=3, ge=1, le=100)
    start_period_seconds: float = Field(default=60, ge=0, le=86400, description="0 means 30 s")


class VolumeIn(Strict):
    """A bind mount of a host directory (A2): the host side under a node's volume
    allow-list, as a model path; read-only unless ``read_only`` is false."""

    host_path: SafeStr = Field(
        max_length=4096,
        description="absolute, inside the allowed volume prefixes of a node you may use",
    )
    container_path: SafeStr = Field(
        max_length=4096,
        description="absolute; not over the model, the platform's /heteroflow or a system "
        "path (/proc, /sys, /dev, /etc, /bin, /sbin, /lib*, /usr, /boot, /run, /var/run)",
    )
    read_only: bool = True


class TaskSpec(Strict):
    """Container-level fields: only here, never at the top level of a group."""

    name: NameStr | None = None
    image: SafeStr = Field(
        default="",
        max_length=512,
        pattern=IMAGE_PATTERN + "|^$",
        description="engine image (tag or name@sha256:digest); empty = one-click: the "
        "server picks from the engines the nodes report (H2)",
    )
    gpu_required: int = Field(default=1, ge=0, le=64, description="0 = CPU engine")
    gpu_type: SafeStr = Field(default="", max_length=64)
    engine: SafeStr = Field(default="", max_length=32)
    model_path: SafeStr = Field(
        default="",
        max_length=4096,
        description="absolute: inside the allowed volume prefixes of a node you may use; "
        "relative: a name under /data/models on the node (no '..' segments)",
    )
    ports: list[PortMapping] = Field(default_factory=list, max_length=16)
    env: list[TextItem] = Field(default_factory=list, max_length=256)
    command: list[TextItem] = Field(default_factory=list, max_length=256)
    engine_args: list[TextItem] = Field(default_factory=list, max_length=256)
    memory_mb: int = Field(default=0, ge=0, le=16 * 1024 * 1024)
    estimated_gpu_memory_mb: int = Field(default=0, ge=0, le=16 * 1024 * 1024)
    kv_offload_gb: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="vLLM CPU KV-cache offload, GiB per instance (1-4096; 0 = off)",
    )
    # issue 28 (A2): the task's own mounts, and whether higher-priority work may stop it
    volumes: list[VolumeIn] = Field(
        default_factory=list, max_length=32,
        description="bind mounts (Docker runtime only); a rolling update keeps them",
    )
    preemptible: bool = Field(
        default=True,
        description="false: the scheduler never stops this task to make room for "
        "higher-priority work (B4)",
    )
    max_loras: int = Field(
        default=0,
        ge=0,
        le=MAX_LORAS,
        description="LoRA adapters its engine holds at once, loaded at runtime and served "
        f"under their own model names (POST .../adapters); 0 = off, at most {MAX_LORAS}; "
        "vLLM only",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v and v not in ENGINES:
            raise ValueError(f"unknown engine {v!r}; one of {', '.join(ENGINES)}")
        return v

    @field_validator("ports")
    @classmethod
    def _unique_ports(cls, v: list[PortMapping]) -> list[PortMapping]:
        seen = [p.container_port for p in v]
        if len(seen) != len(set(seen)):
            raise ValueError("container_port values must be unique")
        return v


# --- issue 14: scaling (A1, I1, I2; core/autoscale.py) ---
class ScalePolicyIn(Strict):
    """``PUT /api/v1/task-groups/{id}/scale-policy`` (and ``scale_policy`` at create).
    A field left out keeps its stored value; enabling needs a metric and a target
    (given now or stored). ``min_replicas`` / ``max_replicas`` set the group's bounds."""

    enabled: bool = True
    metric: Literal["inflight", "tokens_per_s", "queue", "kv_cache"] | None = Field(
        default=None,
        description="inflight: requests in flight per replica (the gateways); "
        "tokens_per_s: tokens answered per second per replica; queue: requests waiting "
        "in the engines per replica; kv_cache: KV-cache use in percent (mean)",
    )
    target: float | None = Field(
        default=None, gt=0, le=1e9, strict=False,
        description="the metric's value per replica to aim for (kv_cache: 1-100 %)",
    )
    min_replicas: int | None = Field(default=None, ge=1, le=MAX_REPLICAS)
    max_replicas: int | None = Field(default=None, ge=1, le=MAX_REPLICAS)

    @field_validator("target")
    @classmethod
    def _target_fits_metric(cls, v: float | None, info: ValidationInfo) -> float | None:
        metric = info.data.get("metric")
        if v is not None and metric is not None:
            problem = target_problem(metric, v)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("max_replicas")
    @classmethod
    def _max_not_below_min(cls, v: int | None, info: ValidationInfo) -> int | None:
        lo = info.data.get("min_replicas")
        if v is not None and lo is not None and v < lo:
            raise ValueError(f"max_replicas {v} is below min_replicas {lo}")
        return v


class ScaleRequest(Strict):
    """``PUT /api/v1/task-groups/{id}/scale``: the replica count, within [min, max]."""

    replicas: int = Field(ge=1, le=MAX_REPLICAS)


def _planned_replicas(data: dict[str, Any]) -> int | None:
    """The replica count create derives from the fields validated so far (the plan
    checks it again): split and pipeline run ``world_size`` tasks, the others one."""
    parallelism, world_size = data.get("parallelism"), data.get("world_size")
    if parallelism is None or world_size is None:
        return None  # invalid already: that error is the one reported
    return int(world_size) if parallelism in ("split", "pipeline") else 1


def _check_bounds(data: dict[str, Any], lo: int | None, hi: int | None, prefix: str = "") -> None:
    planned = _planned_replicas(data)
    if planned is None:
        return
    task_type = "inference" if _is_inference(data) else (data.get("task_type") or "container")
    try:
        create_bounds(
            replicas=planned, task_type=task_type, parallelism=str(data["parallelism"]),
            min_replicas=lo, max_replicas=hi, prefix=prefix,
        )
    except ValidationFailed as exc:
        raise ValueError(exc.message) from None
# --- end issue 14 (scaling) ---


class TaskGroupCreate(Strict):
    name: SafeStr = Field(max_length=63, pattern=NAME_PATTERN)
    model_name: ModelNameStr | None = None
    task_type: Literal["inference", "training", "container"] | None = None
    parallelism: Literal["single", "tensor_parallel", "split", "pipeline"] = "single"
    world_size: int = Field(default=1, ge=1, le=64)
    enable_api: bool = False
    idle_timeout_minutes: int = Field(default=0, ge=0, le=525600)
    gpu_memory_utilization: int = Field(default=90, ge=1, le=100)
    priority: int = Field(default=0, ge=0, le=1000)
    priority_class: Literal["tenant", "platform"] = Field(
        default="tenant",
        description="tenant: the priority ranks only within your tenant (and its sharing "
        "group); platform (operators only): may preempt any tenant's lower-priority work",
    )
    endpoint_name: NameStr | None = None
    endpoint_port: int | None = Field(default=None, ge=1, le=65535)
    external_port: int = Field(default=0, ge=0, le=65535)
    health_check: HealthCheckIn | None = None
    labels: Labels = Field(default_factory=dict)
    task: TaskSpec
    # --- issue 13 (recovery / run timeout, A10): after `task`, so its check sees it ---
    run_timeout_seconds: int = Field(
        default=0,
        ge=0,
        le=366 * 86400,
        description="training / container only: a task running longer is stopped and "
        "fails with the reason; 0 = no limit. Inference services are exempt (400)",
    )
    # issue 14 (K1): when it serves; outside, the window's action holds
    schedule_window: ScheduleWindowIn | None = None
    # --- issue 14 (A1, I1, I2): the replica bounds and the autoscaler's policy; after
    # `task`, `parallelism` and `world_size`, so their checks see the planned count ---
    min_replicas: int | None = Field(
        default=None, ge=1, le=MAX_REPLICAS,
        description="default: the replica count the group starts with (split: "
        "world_size; single, tensor_parallel: 1)",
    )
    max_replicas: int | None = Field(
        default=None, ge=1, le=MAX_REPLICAS,
        description="default: the replica count the group starts with (at least min)",
    )
    scale_policy: ScalePolicyIn | None = None

    @field_validator("min_replicas")
    @classmethod
    def _min_fits(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None:
            _check_bounds(info.data, v, None)
        return v

    @field_validator("max_replicas")
    @classmethod
    def _max_fits(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None:
            _check_bounds(info.data, info.data.get("min_replicas"), v)
        return v

    @field_validator("scale_policy")
    @classmethod
    def _policy_fits(cls, v: ScalePolicyIn | None, info: ValidationInfo) -> ScalePolicyIn | None:
        if v is None:
            return v
        data = info.data
        if v.enabled and (v.metric is None or v.target is None):
            raise ValueError("an enabled scale_policy needs a metric and a target")
        if v.enabled and _planned_replicas(data) is not None:
            problem = scalable_problem(
                "inference" if _is_inference(data) else str(data.get("task_type") or "container"),
                str(data.get("parallelism")),
            )
            if problem:
                raise ValueError(problem)
        for name in ("min_replicas", "max_replicas"):
            given, top = getattr(v, name), data.get(name)
            if given is not None and top is not None and given != top:
                raise ValueError(f"{name} {given} differs from the group's {name} {top}")
        _check_bounds(
            data,
            v.min_replicas if v.min_replicas is not None else data.get("min_replicas"),
            v.max_replicas if v.max_replicas is not None else data.get("max_replicas"),
        )
        return v
    # --- end issue 14 (scaling) ---

    @field_validator("run_timeout_seconds")
    @classmethod
    def _run_timeout_not_for_inference(cls, v: int, info: ValidationInfo) -> int:
        if v and _is_inference(info.data):
            raise ValueError(
                "inference services are long-running and have no run timeout (A10); "
                "it is for training and container groups"
            )
        return v


def _is_inference(data: dict[str, Any]) -> bool:
    """The task type create infers (services.planning.infer_task_type), from the fields
    validated so far: explicit, else inference when a model path, the API or an engine
    (named, labelled or read from the image) says so. The plan checks it again."""
    if data.get("task_type"):
        return bool(data["task_type"] == "inference")
    task = data.get("task")
    if not isinstance(task, TaskSpec):
        return False  # the task itself is invalid: that error is the one reported
    labels = data.get("labels") or {}
    engine, _ = resolve_engine(task.engine, str(labels.get("heteroflow.engine", "")), task.image)
    return bool(task.model_path or data.get("enable_api") or engine)


class TaskGroupPatch(Strict):
    """D4: what may change alone on a running group (no generation bump, no rebuild).
    Any other field is refused with 400 naming it."""

    health_check: HealthCheckIn | None = None
    idle_timeout_minutes: int | None = Field(default=None, ge=0, le=525600)
# --- end issue 13 (recovery) ---


# --- issue 14: rolling update / recreate (J1-J4) ---
class TaskGroupUpdate(Strict):
    """``PUT /api/v1/task-groups/{id}/update``: a new generation of every replica with the
    given task intent changed (what is left out is inherited from the current one). At
    least one of ``image``, ``engine_args``, ``env``, ``command``, ``kv_offload_gb``."""

    strategy: Literal["rolling", "recreate"] = Field(
        default="rolling",
        description="rolling: batch by batch, the old replicas drain before they stop "
        "(inference services); recreate: stop all, then create all",
    )
    image: Annotated[
        str, StringConstraints(max_length=512, pattern=IMAGE_PATTERN), AfterValidator(no_nul)
    ] | None = Field(
        default=None,
        description="the engine image of the new generation (tag or name@sha256:digest)",
    )
    engine_args: list[TextItem] | None = Field(default=None, max_length=256)
    env: list[TextItem] | None = Field(default=None, max_length=256)
    command: list[TextItem] | None = Field(default=None, max_length=256)
    kv_offload_gb: int | None = Field(
        default=None, ge=0, le=4096,
        description="C12: changes only together with a new image (vLLM only)",
    )
    batch_size: int = Field(
        default=1, ge=1, le=64, description="rolling: replicas replaced at a time"
    )
# --- end issue 14 (rollout) ---


class TaskRead(BaseModel):
    id: str
    group_id: str
    name: str
    rank: int
    generation: int
    task_type: str
    status: str
    status_message: str
    gpu_required: int
    gpu_type: str
    gpu_ids: list[int]
    node_id: str | None
    model_path: str
    image: str
    engine: str
    engine_reason: str
    ports: list[dict[str, int | bool]]
    estimated_gpu_memory_mb: int
    estimate_detail: str
    memory_mb: int
    kv_offload_gb: int
    launch_argv: list[str]
    volumes: list[dict[str, Any]] = Field(default_factory=list)  # A2
    preemptible: bool = True  # B4: false = never a preemption's victim
    max_loras: int = 0  # LoRA adapters its engine holds at once (0 = off)
    # H5: derived at placement (gold: MIG, silver: MPS, else bronze); "" until placed
    qos: str = ""
    # B4: the task this one is being stopped for (it returns to the queue afterwards)
    preempted_by: str = ""
    priority: int = 0
    priority_class: str = "tenant"
    # M11: the gateway sends it no new requests (POST/DELETE /api/v1/tasks/{id}/drain)
    draining: bool = False
    # E1: rebuilds in a row behind this task; the task that replaced it ("" = current)
    rebuild_count: int = 0
    replaced_by: str = ""
    running_at: datetime | None = None  # when it last became running
    wake_requested: bool = False  # F3: a wake waiting for its node or card
    started_at: datetime | None
    created_at: datetime
    updated_at: datetime


class TaskGroupRead(BaseModel):
    id: str
    tenant_id: str
    name: str
    model_name: str
    task_type: str
    parallelism: str
    world_size: int
    current_replicas: int
    min_replicas: int
    max_replicas: int
    enable_api: bool
    # read from a row: its ``endpoint_id`` (services.views)
    endpoint: str | None = Field(validation_alias=AliasChoices("endpoint", "endpoint_id"))
    inference_templates: list[Any]
    current_generation: int
    rolling_update_state: str | None
    rolling_update_message: str | None
    idle_timeout_minutes: int
    gpu_memory_utilization: int
    priority: int
    priority_class: str = "tenant"
    # "running", or "stopped" by its owner (recovery rebuilds only what should run)
    desired: str = "running"
    run_timeout_seconds: int = 0  # A10: training / container only; 0 = never
    last_request_at: datetime | None = None  # F4: the gateway's last request for it
    scale_policy: dict[str, Any] = Field(default_factory=dict)  # I1 (the autoscaler)
    schedule_window: dict[str, Any] = Field(default_factory=dict)  # K1
    # K1: the window's action in effect ("" = none) and the replica count it saved
    window_action: str = ""
    window_saved_replicas: int | None = None
    health_check: dict[str, Any]
    labels: dict[str, Any]
    status: str
    status_message: str
    created_at: datetime
    updated_at: datetime
    # its current tasks (one per rank); replaced ones stay readable at /api/v1/tasks/{id}
    tasks: list[TaskRead] = Field(default_factory=list)
    # issue 15: what its model can answer (null fields: unknown)
    capabilities: CapabilitiesRead = Field(default_factory=CapabilitiesRead)
    # LoRA adapters served beside its model under their own names ({name, path})
    lora_adapters: list[dict[str, str]] = Field(default_factory=list)


class TaskGroupCreated(TaskGroupRead):
    api_key: str | None = Field(default=None, description="plaintext, shown only in this response")
    warnings: list[str] = Field(default_factory=list)
    # issue 16 (L2-L4): set when an existing service was reused instead of a new one
    dedup: DedupRead | None = None


class EventRead(BaseModel):
    group_id: str | None
    task_id: str | None
    kind: str
    from_status: str
    to_status: str
    message: str
    created_at: datetime


class ContainerPlanRead(BaseModel):
    name: str
    image: str
    entrypoint: list[str] | None
    command: list[str]
    env: dict[str, str]
    ports: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    ipc_mode: str | None
    shm_size: str | None
    network_mode: str | None
    gpu: dict[str, Any] | None
    labels: dict[str, str] = Field(default_factory=dict)
    security: dict[str, Any] = Field(
        default_factory=dict, description="privileged, capabilities, security options, pids"
    )
    config_files: list[str] = Field(
        default_factory=list, description="engine config files the agent writes (targets)"
    )
    runtime: str = Field(
        default="docker",
        description="the node's runtime: docker (this container), or process (command is "
        "the whole argv the agent starts; <agent-python> / <vllm-python> stand for its "
        "interpreters)",
    )


class ModelSourceRead(BaseModel):
    """Issue 29: what a model source named at create time (the dry run shows it)."""

    source: str
    kind: str = Field(description="hf, modelscope, url or fleet")
    resolved: bool = Field(
        default=True,
        description="false for a URL: the server contacts only the operator's hubs, a URL "
        "is resolved by the node that fetches it (its files and size unknown here); a "
        "fleet copy is resolved from the holders' reports (size and revision)",
    )
    revision: str = Field(description="the resolved revision (a hub's commit); '' if none")
    bytes: int | None = Field(description="the files' total size; null if a size is unknown")
    file_count: int
    files: list[dict[str, Any]] = Field(description="path, bytes, sha256 (the first 50)")
    cached_on: list[str] = Field(
        default_factory=list, description="nodes whose cache holds this revision complete"
    )
    download_s: float | None = Field(
        default=None,
        description="what a start on a node without a copy adds: the size over the nominal "
        "rate (model_download_mb_s); null if the size is unknown",
    )


class PlannedTask(BaseModel):
    rank: int
    gpu_required: int
    placement: dict[str, Any] | None = Field(description="node, cards, host ports; null if none")
    pending_reason: str | None
    container: ContainerPlanRead | None = Field(description="null when it cannot be built")
    command_error: str | None = None


class DryRunPlan(BaseModel):
    dry_run: bool = True
    name: str
    model_name: str
    task_type: str
    parallelism: str
    engine: str
    engine_reason: str
    image: str
    estimated_gpu_memory_mb: int
    memory_mb: int
    estimate_detail: str | None
    tasks: list[PlannedTask]
    warnings: list[str]
    # issue 16 (L2): what the create would reuse (then nothing would be placed: no tasks)
    dedup: DedupRead | None = None
    # issue 29: the model source's files as the source names them now (null: a path)
    model_source: ModelSourceRead | None = None
