"""Wire schemas of nodes and of the agent protocol (heartbeat, claim, report)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints, model_validator

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.events import ReportedFault
from heteroflow.core.model_sources import parse_model_source
from heteroflow.core.states import NOTE_TARGETS, ReportTarget, TaskStatus
from heteroflow.schemas.common import (
    LABEL_KEY_PATTERN,
    MAX_INT32,
    MAX_INT64,
    MAX_LABELS,
    MAX_TEXT_ITEM,
    SafeStr,
    ScrubbedStr,
    Strict,
    no_nul,
)
from heteroflow.schemas.registry_credentials import RegistryAuth

# What the agent reports is read as strictly as a user's request, field by field (the
# agent builds these models in Python from dataclasses, so lists may arrive as tuples).
Count = Annotated[int, Field(ge=0, le=MAX_INT32, strict=True)]
Percent = Annotated[float, Field(ge=0, le=100, allow_inf_nan=False, strict=True)]
ShortText = Annotated[str, StringConstraints(max_length=256), AfterValidator(no_nul)]
# A node's volume rule: an absolute path (the agent refuses relative ones in its config).
VolumePrefix = Annotated[
    str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/"), AfterValidator(no_nul)
]
MAX_VOLUME_PREFIXES = 64
HostPort = Annotated[int, Field(ge=1, le=65535, strict=True)]
MAX_REPORTED_PORTS = 8192  # listening ports a heartbeat carries (agent: the lowest first)
ImageRef = Annotated[str, StringConstraints(max_length=512), AfterValidator(no_nul)]
# Node labels: the label keys of task groups; values may be longer (heteroflow.tenants
# lists tenant ids).
NodeLabelKey = Annotated[
    str, StringConstraints(max_length=63, pattern=LABEL_KEY_PATTERN), AfterValidator(no_nul)
]
NodeLabelValue = Annotated[
    str, StringConstraints(max_length=MAX_TEXT_ITEM), AfterValidator(no_nul)
]


class GpuCardWire(BaseModel):
    index: int = Field(ge=0, le=1024, strict=True)
    uuid: ShortText = ""
    vendor: ShortText = "nvidia"
    model: ShortText = ""
    memory_total_mb: Count
    memory_used_mb: Count = 0
    compute_capability: ShortText | None = None
    mig_capable: bool = Field(default=False, strict=True)
    # MIG mode on now (NVML); None = not reported: mig_capable stands for it (declared)
    mig_enabled: bool | None = Field(default=None, strict=True)
    mps_capable: bool = Field(default=False, strict=True)
    temperature_c: int | None = Field(default=None, ge=-273, le=1000, strict=True)
    # % of NVML's last sample period the card was busy (the card series); None: unread
    utilization_pct: int | None = Field(default=None, ge=0, le=100, strict=True)
    # indices of the node's cards this card reaches over NVLink (topology scoring, B1)
    nvlink_peers: list[Annotated[int, Field(ge=0, le=1024, strict=True)]] = Field(
        default_factory=list, max_length=1024
    )
    source: ShortText = "declared"


class InventoryWire(BaseModel):
    gpus: list[GpuCardWire] = Field(default_factory=list, max_length=1024)
    cpu_count: Count = 0
    memory_total_mb: Count = 0
    memory_available_mb: Count = 0
    cpu_percent: Percent = 0.0
    memory_percent: Percent = 0.0


class ModelWire(BaseModel):
    """One model the agent's scan found (``agent.model_scan.ScannedModel``). Names come
    from the disk: undecodable text becomes U+FFFD rather than failing the heartbeat."""

    name: ScrubbedStr = Field(default="", max_length=4096)
    path: ScrubbedStr = Field(default="", max_length=4096)
    format: ShortText = ""
    size_bytes: int = Field(default=0, ge=0, le=MAX_INT64, strict=True)
    files: list[Annotated[ScrubbedStr, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=10_000
    )
    mtime: float = Field(default=0.0, ge=-1e12, le=1e12, allow_inf_nan=False, strict=True)


# issue 29: what a heartbeat says of the node's model cache (complete models and downloads
# in progress, ``agent.cache_report``): a bounded list, each entry a source the platform
# parsed (never a URL with user info or a query: no credential can ride in one)
MAX_CACHED_MODELS = 256
CacheKey = Annotated[
    str, StringConstraints(max_length=120, pattern=r"^[A-Za-z0-9._-]{1,120}$"),
    AfterValidator(no_nul),
]


def _model_source(value: str) -> str:
    try:
        remote = parse_model_source(value).remote
    except ValidationFailed as e:
        raise ValueError(str(e)) from None
    if not remote:
        raise ValueError("a cached model's source is a URL (hf://, modelscope://, https://)")
    return value


# Where an agent serves its model cache to the other agents (issue 29): scheme, host and
# port, nothing else (no user info, path or query: the address is shown and stored).
PeerUrl = Annotated[
    str,
    StringConstraints(
        max_length=300,
        pattern=r"^(https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):[0-9]{1,5})?$",
    ),
    AfterValidator(no_nul),
]


class PeerCopy(BaseModel):
    """A node that holds a task's model and serves it to its peers (issue 29): where to
    copy it from (``url``, the node's ``peer_url``) and under which cache ``key``."""

    node: str
    url: PeerUrl
    key: CacheKey


class CachedModelWire(BaseModel):
    """One model revision in the node's cache (``agent.model_cache.CachedModel``)."""

    key: CacheKey
    source: Annotated[
        str, StringConstraints(max_length=2048), AfterValidator(no_nul),
        AfterValidator(_model_source),
    ]
    revision: ShortText = ""
    size_bytes: int = Field(default=0, ge=0, le=MAX_INT64, strict=True)  # so far, downloading
    state: Literal["complete", "downloading"] = "complete"


class Heartbeat(Strict):
    name: SafeStr = Field(max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
    address: ShortText = Field(min_length=1, max_length=255)
    runtime: Literal["process", "docker"] = "process"
    inventory: InventoryWire
    labels: dict[NodeLabelKey, NodeLabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    models: list[ModelWire] = Field(default_factory=list, max_length=10_000)
    # issue 29: the node's model cache (stored with ``models``: services/agents/nodes.py)
    model_cache: list[CachedModelWire] = Field(default_factory=list, max_length=MAX_CACHED_MODELS)
    # issue 29: where this node's agent serves its cache to the others ('' for nowhere)
    peer_url: PeerUrl = ""
    # engine -> exact image ref ("" for an engine the process runtime runs itself)
    engines: dict[ShortText, ImageRef] = Field(default_factory=dict, max_length=64)
    # the agent's volume rules (C4): create refuses an absolute model_path that no node
    # the caller may use allows (an agent that reports none allows no absolute path)
    allowed_volume_prefixes: list[VolumePrefix] = Field(
        default_factory=list, max_length=MAX_VOLUME_PREFIXES
    )
    denied_volume_prefixes: list[VolumePrefix] = Field(
        default_factory=list, max_length=MAX_VOLUME_PREFIXES
    )
    # TCP ports something listens on at the node's host, whatever holds them: the port
    # pool skips them there (P2), so a port is handed out only when it is really free
    host_ports_in_use: list[HostPort] = Field(default_factory=list, max_length=MAX_REPORTED_PORTS)


class TaskAssignment(BaseModel):
    """What an agent needs to run one task."""

    id: str
    group_id: str
    name: str
    status: str
    task_type: str
    model_name: str
    model_path: str
    image: str
    engine: str
    command: list[str]
    engine_args: list[str]
    env: list[str]
    ports: list[dict[str, int | bool]]
    gpu_ids: list[int]
    gpu_required: int
    memory_mb: int
    kv_offload_gb: int = 0
    generation: int = 1
    # G1 / issue 32: its stage's rank in a pipeline gang (0 outside one): only rank 0
    # serves the API (core.gang.serves_api), so only it gets a door and an HTTP probe
    rank: int = 0
    gpu_memory_utilization: int = 90
    parallelism: str = "single"
    health_check: dict[str, Any]
    # A2: bind mounts {host_path, container_path, read_only}; the agent checks them again
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    # LoRA (core.lora): the engine's adapter slots, and its group's adapters, which the
    # agent loads into the running engine (heartbeat replies; a claim carries none)
    max_loras: int = 0
    lora_adapters: list[dict[str, str]] = Field(default_factory=list)
    # C14: the engine's own secret (core.engine_access): the agent gives it to the engine
    # and its door checks it; never in a repr, a log line or the management API
    engine_key: str = Field(default="", repr=False)
    # H7: the login for pulling ``image`` (the tenant's own for its registry, else the
    # platform's), only in the claim reply to this node's agent; never in a repr or a log
    registry_auth: RegistryAuth | None = Field(default=None, repr=False)
    # H9: the token for its model's hub (the tenant's own, else the platform's; None: the
    # node's ``hub_token``), only in the claim reply, as ``registry_auth``; never in a repr
    hub_token: str | None = Field(default=None, repr=False)
    # G1: a pipeline stage's place in its gang (core.gang.GangPlace as a dict: rank,
    # world_size, master_addr, master_port), in the claim reply and the heartbeat's (a
    # wake relaunches a stage from it); None outside a gang or while it is not whole
    gang: dict[str, Any] | None = None
    # issue 29: set by the agent alone, once it fetched a model source into its cache and
    # put the cache's path in ``model_path`` (agent/fetching.py): that path, and only it,
    # passes the node's allow-list; never sent by the server, never serialised
    model_fetched: bool = Field(default=False, exclude=True, repr=False)
    # issue 29: nodes that hold this task's model source and serve it to their peers
    # (services.agents.copies), in the claim reply only: the agent copies from them
    # before it asks the source's origin; for a fleet:// source they are the only way
    model_peers: list[PeerCopy] = Field(default_factory=list)


class HeartbeatReply(BaseModel):
    node_id: str
    tasks: list[TaskAssignment]


#: What a note on a starting / waking task is about (D5), on a running one (LoRA) or a
#: sleeping one (F1: how its engine sleeps); none: a launch retried.
LoadNote = Literal[
    "loading", "progress", "pull", "pulling", "fetch", "fetching", "adapter", "asleep"
]


class TaskReport(Strict):
    # the state the report moves the task to (running | failed | stopped | completed; a
    # note: starting; given back: pending (ports taken), scheduled (its engine stopped
    # with the agent: started again on the same placement))
    status: ReportTarget
    message: ScrubbedStr = Field(default="", max_length=8192)
    argv: list[Annotated[ScrubbedStr, Field(max_length=MAX_TEXT_ITEM)]] | None = Field(
        default=None, max_length=4096, description="as launched"
    )
    # why a task failed, when the agent knows it was a fault rather than a launch error (E2)
    fault: ReportedFault | None = Field(
        default=None, description="the fault behind a 'failed' report; becomes fault.<kind>"
    )
    # with status 'pending': the host ports found taken at launch (the pool's choices);
    # the task is placed again with other ports and the node's view of them is updated
    busy_ports: list[HostPort] = Field(default_factory=list, max_length=16)
    # D5: a note on a starting or waking task about its load: 'loading' (its window
    # opened: an event and the status message), 'progress' (the status message alone)
    note: LoadNote | None = Field(
        default=None, description="with status starting / waking: what the note is about"
    )

    @model_validator(mode="after")
    def _fault_only_on_failure(self) -> TaskReport:
        if self.fault is not None and self.status != TaskStatus.FAILED:
            raise ValueError("fault is only allowed with status 'failed'")
        if (self.status == TaskStatus.PENDING) != bool(self.busy_ports):
            raise ValueError("busy_ports goes with status 'pending', and only with it")
        if self.note == "adapter" and self.status != TaskStatus.RUNNING:
            raise ValueError("note 'adapter' (LoRA) goes with status 'running' only")
        if self.note not in (None, "adapter") and self.status not in NOTE_TARGETS:
            raise ValueError("note goes with status 'starting', 'waking' or 'sleeping' only")
        if (self.note == "asleep") != (self.status == TaskStatus.SLEEPING):
            raise ValueError("note 'asleep' goes with status 'sleeping', and only with it")
        if self.status == TaskStatus.WAKING and self.note is None:
            raise ValueError("status 'waking' is a note: it needs a note")
        return self


class NodeRead(BaseModel):
    id: str
    name: str
    address: str
    runtime: str
    status: Literal["online", "offline"]
    gpus: list[GpuCardWire]
    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int
    cpu_percent: float
    memory_percent: float
    labels: dict[str, Any]
    engines: dict[str, str]
    models: list[dict[str, Any]]
    # where model files may live on the node (absolute model paths must be inside)
    allowed_volume_prefixes: list[str] = Field(default_factory=list)
    denied_volume_prefixes: list[str] = Field(default_factory=list)
    # TCP ports in use on the node's host at its last heartbeat (the pool skips them)
    host_ports_in_use: list[int] = Field(default_factory=list)
    # where its agent serves its model cache to the other agents ('' for nowhere)
    peer_url: str = ""
    registered_at: datetime
    last_heartbeat_at: datetime


class TemplateRead(BaseModel):
    engine: str
    image: str
    reason: str
