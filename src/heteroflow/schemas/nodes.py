"""Wire schemas of nodes and of the agent protocol (heartbeat, claim, report)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from heteroflow.schemas.common import Strict


class GpuCardWire(BaseModel):
    index: int = Field(ge=0, le=1024)
    uuid: str = ""
    vendor: str = "nvidia"
    model: str = ""
    memory_total_mb: int = Field(ge=0)
    memory_used_mb: int = Field(default=0, ge=0)
    compute_capability: str | None = None
    mig_capable: bool = False
    mps_capable: bool = False
    temperature_c: int | None = None
    # indices of the node's cards this card reaches over NVLink (topology scoring, B1)
    nvlink_peers: list[int] = Field(default_factory=list, max_length=1024)
    source: str = "declared"


class InventoryWire(BaseModel):
    gpus: list[GpuCardWire] = Field(default_factory=list, max_length=1024)
    cpu_count: int = Field(default=0, ge=0)
    memory_total_mb: int = Field(default=0, ge=0)
    memory_available_mb: int = Field(default=0, ge=0)
    cpu_percent: float = 0.0
    memory_percent: float = 0.0


class Heartbeat(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
    address: str = Field(min_length=1, max_length=255)
    runtime: Literal["process", "docker"] = "process"
    inventory: InventoryWire
    labels: dict[str, str] = Field(default_factory=dict)
    models: list[dict[str, Any]] = Field(default_factory=list)
    # engine -> exact image ref ("" for an engine the process runtime runs itself)
    engines: dict[str, str] = Field(default_factory=dict)


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
    ports: list[dict[str, int]]
    gpu_ids: list[int]
    gpu_required: int
    memory_mb: int
    kv_offload_gb: int = 0
    generation: int = 1
    gpu_memory_utilization: int = 90
    parallelism: str = "single"
    health_check: dict[str, Any]


class HeartbeatReply(BaseModel):
    node_id: str
    tasks: list[TaskAssignment]


# Why a task failed, when the agent knows it was a fault rather than a launch error (E2).
FaultKind = Literal["container_lost", "engine_exited", "unhealthy"]


class TaskReport(Strict):
    status: Literal["running", "failed", "stopped", "completed"]
    message: str = Field(default="", max_length=8192)
    argv: list[str] | None = Field(default=None, max_length=4096, description="as launched")
    fault: FaultKind | None = Field(
        default=None, description="the fault behind a 'failed' report; becomes fault.<kind>"
    )

    @model_validator(mode="after")
    def _fault_only_on_failure(self) -> TaskReport:
        if self.fault is not None and self.status != "failed":
            raise ValueError("fault is only allowed with status 'failed'")
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
    registered_at: datetime
    last_heartbeat_at: datetime


class TemplateRead(BaseModel):
    engine: str
    image: str
    reason: str
