"""ORM tables. Rows never leave the service layer: the API returns wire schemas."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both SQLite (which stores naive) and PostgreSQL."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the database")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON, list[Any]: JSON}


class PlatformSetting(Base):
    """Cluster-wide values every server instance must share (e.g. the JWT secret)."""

    __tablename__ = "platform_settings"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class SharingGroup(Base):
    """Tenants whose work may share a GPU card (N3, B5); managed by operators only."""

    __tablename__ = "sharing_groups"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime]


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # a tenant is in at most one sharing group; NULL = shares cards only with itself
    sharing_group_id: Mapped[str | None] = mapped_column(
        ForeignKey("sharing_groups.id"), nullable=True, default=None
    )
    # the highest group priority a member of this tenant may set (operators: any)
    priority_ceiling: Mapped[int] = mapped_column(Integer, default=100)
    # quotas (N2, core/quotas.py); 0 = no limit. Cards are whole cards by commitment.
    quota_cards: Mapped[int] = mapped_column(Integer, default=0)
    quota_services: Mapped[int] = mapped_column(Integer, default=0)
    quota_replicas: Mapped[int] = mapped_column(Integer, default=0)
    quota_cpu_memory_mb: Mapped[int] = mapped_column(Integer, default=0)
    # tokens per quota_token_period ("day" | "month" | "") at the gateway, beside each
    # key's own budget; 0 = no limit (0014)
    quota_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    quota_token_period: Mapped[str] = mapped_column(String(16), default="")
    # N5: members see and manage only the services they created (operators: all) (0014)
    members_see_own: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]


class User(Base):
    __tablename__ = "users"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    username: Mapped[str] = mapped_column(String(128), unique=True)
    password_hash: Mapped[str] = mapped_column(String(256))
    role: Mapped[str] = mapped_column(String(16))  # operator | member
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    # tokens issued before this moment are refused (password reset, role change)
    tokens_valid_after: Mapped[datetime | None] = mapped_column(nullable=True, default=None)
    created_at: Mapped[datetime]


class LoginThrottle(Base):
    """Failed logins per key ("user:<name>" or "addr:<ip>"), shared by every server
    instance: after a few failures the key is blocked with an exponential back-off."""

    __tablename__ = "login_throttle"
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    blocked_until: Mapped[datetime | None] = mapped_column(nullable=True, default=None)
    updated_at: Mapped[datetime]


class AuditRecord(Base):
    """One row per management write (who, what, when, from where); operators read it."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_tenant_time", "tenant_id", "created_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(index=True)
    user_id: Mapped[str] = mapped_column(String(32), default="")
    username: Mapped[str] = mapped_column(String(128), default="")
    tenant_id: Mapped[str] = mapped_column(String(32), default="")
    role: Mapped[str] = mapped_column(String(16), default="")  # operator|member|agent|gateway|""
    method: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(String(512))
    status: Mapped[int] = mapped_column(Integer)
    remote_addr: Mapped[str] = mapped_column(String(64), default="")
    detail: Mapped[str] = mapped_column(Text, default="")


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(253), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    runtime: Mapped[str] = mapped_column(String(32))
    # the agent's volume rules (C4), reported so create can refuse a path no node allows
    allowed_volume_prefixes: Mapped[list[Any]] = mapped_column(default=list)
    denied_volume_prefixes: Mapped[list[Any]] = mapped_column(default=list)
    # TCP ports something listens on at the node's host (last heartbeat), plus any a
    # launch found taken since: the port pool skips them on this node (P2)
    host_ports_in_use: Mapped[list[Any]] = mapped_column(default=list)
    gpus: Mapped[list[Any]] = mapped_column(default=list)
    cpu_count: Mapped[int] = mapped_column(Integer, default=0)
    memory_total_mb: Mapped[int] = mapped_column(Integer, default=0)
    memory_available_mb: Mapped[int] = mapped_column(Integer, default=0)
    cpu_percent: Mapped[float] = mapped_column(default=0.0)
    memory_percent: Mapped[float] = mapped_column(default=0.0)
    models: Mapped[list[Any]] = mapped_column(default=list)
    # engine -> the exact image ref (or "" for a process engine) the node reports available
    engines: Mapped[dict[str, Any]] = mapped_column(default=dict)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # where the agent serves its model cache to the other agents ('' for nowhere): copies
    # between nodes (issue 29)
    peer_url: Mapped[str] = mapped_column(String(300), default="")
    # bumped by every placement on the node: the compare-and-set that keeps two
    # schedulers (threads or server instances) from booking the same card twice
    booking_version: Mapped[int] = mapped_column(Integer, default=0)
    registered_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime]


class TaskGroup(Base):
    __tablename__ = "task_groups"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_by: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(128))
    model_name: Mapped[str] = mapped_column(String(256))
    task_type: Mapped[str] = mapped_column(String(32))
    parallelism: Mapped[str] = mapped_column(String(32))
    world_size: Mapped[int] = mapped_column(Integer)
    current_replicas: Mapped[int] = mapped_column(Integer)
    min_replicas: Mapped[int] = mapped_column(Integer)
    max_replicas: Mapped[int] = mapped_column(Integer)
    enable_api: Mapped[bool] = mapped_column(Boolean)
    endpoint_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    inference_templates: Mapped[list[Any]] = mapped_column(default=list)
    current_generation: Mapped[int] = mapped_column(Integer, default=1)
    rolling_update_state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    rolling_update_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    idle_timeout_minutes: Mapped[int] = mapped_column(Integer, default=0)
    # what its owner wants: "running" (recovery rebuilds what fails) or "stopped" (a user
    # stop: the only thing that stops a service for good; start sets it back) (0011)
    desired: Mapped[str] = mapped_column(String(16), default="running")
    # A10: training / container tasks are stopped after this long running; 0 = never
    run_timeout_seconds: Mapped[int] = mapped_column(Integer, default=0)
    # F4: the last request the gateway routed to it (the idle timer's start)
    last_request_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # K1: what the schedule window's executor put in effect ("" = none; pause | scale |
    # stop) and the replica count it saved first, to restore back inside (0012)
    window_action: Mapped[str] = mapped_column(String(16), default="")
    window_saved_replicas: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # LoRA adapters served beside the base model, each under its own model name:
    # [{name, path}], loaded into the running engines at runtime (0016)
    lora_adapters: Mapped[list[Any]] = mapped_column(default=list)
    # J1/J4: a rollout's execution lease (holder = server instance id, "" = none; TTL
    # renewed while it runs, held at most a bound), when it began, and what it rolls out
    rollout_holder: Mapped[str] = mapped_column(String(64), default="")
    rollout_expires_at: Mapped[datetime | None] = mapped_column(nullable=True)
    rollout_started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    rollout_spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # I1: the autoscaler's last decision (every decision is also an event)
    autoscaled_at: Mapped[datetime | None] = mapped_column(nullable=True)
    gpu_memory_utilization: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # "tenant": the priority ranks only within the tenant's sharing key (a member's);
    # "platform": set by an operator, may preempt any tenant's lower-priority work
    priority_class: Mapped[str] = mapped_column(String(16), default="tenant")
    health_check: Mapped[dict[str, Any]] = mapped_column(default=dict)
    scale_policy: Mapped[dict[str, Any]] = mapped_column(default=dict)
    schedule_window: Mapped[dict[str, Any]] = mapped_column(default=dict)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(32))
    status_message: Mapped[str] = mapped_column(Text, default="")
    deleted_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Task(Base):
    __tablename__ = "tasks"
    __table_args__ = (Index("ix_tasks_status_priority", "status", "priority", "created_at"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    group_id: Mapped[str] = mapped_column(ForeignKey("task_groups.id"), index=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(160))
    rank: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(Integer, default=1)
    task_type: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32))
    status_message: Mapped[str] = mapped_column(Text, default="")
    gpu_required: Mapped[int] = mapped_column(Integer)
    gpu_type: Mapped[str] = mapped_column(String(64), default="")
    gpu_ids: Mapped[list[Any]] = mapped_column(default=list)
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id"), nullable=True, index=True)
    model_path: Mapped[str] = mapped_column(Text, default="")
    model_name: Mapped[str] = mapped_column(String(256), default="")
    image: Mapped[str] = mapped_column(String(512), default="")
    engine: Mapped[str] = mapped_column(String(32), default="")
    engine_reason: Mapped[str] = mapped_column(Text, default="")
    command: Mapped[list[Any]] = mapped_column(default=list)
    engine_args: Mapped[list[Any]] = mapped_column(default=list)
    env: Mapped[list[Any]] = mapped_column(default=list)
    ports: Mapped[list[Any]] = mapped_column(default=list)
    estimated_gpu_memory_mb: Mapped[int] = mapped_column(Integer, default=0)
    estimate_detail: Mapped[str] = mapped_column(Text, default="")
    memory_mb: Mapped[int] = mapped_column(Integer, default=0)
    kv_offload_gb: Mapped[int] = mapped_column(Integer, default=0)
    # the engine command as the agent built it (argv), shown once the task launched
    launch_argv: Mapped[list[Any]] = mapped_column(default=list)
    gpu_memory_utilization: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    priority_class: Mapped[str] = mapped_column(String(16), default="tenant")
    health_check: Mapped[dict[str, Any]] = mapped_column(default=dict)
    qos: Mapped[str] = mapped_column(String(16), default="")  # gold|silver|bronze (H5)
    # M11: a draining replica gets no new gateway requests; in-flight ones finish
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    # B4: the task this one is being stopped for; it returns to pending once stopped
    preempted_by: Mapped[str] = mapped_column(String(32), default="")
    # E1: rebuilds behind this task in a row (0 = the original); reset once the one it
    # replaced had run stably; the task that replaced this one ("" = current) (0011)
    rebuild_count: Mapped[int] = mapped_column(Integer, default=0)
    replaced_by: Mapped[str] = mapped_column(String(32), default="")
    # when it last became running (E1's stability window, A10's run timeout)
    running_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # F3: a wake asked for while it could not happen (node offline, card borrowed)
    wake_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # N5: the member it belongs to — its group's creator, whoever made it (0014)
    created_by: Mapped[str] = mapped_column(String(32), default="")
    # A2 (0016): bind mounts [{host_path, container_path, read_only}] under the node's
    # volume allow-list, and whether higher-priority work may stop it (B4)
    volumes: Mapped[list[Any]] = mapped_column(default=list)
    preemptible: Mapped[bool] = mapped_column(Boolean, default=True)
    # how many LoRA adapters its engine holds at once (0 = LoRA off) (0016)
    max_loras: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class InferenceEndpoint(Base):
    __tablename__ = "inference_endpoints"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_endpoint_tenant_name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    group_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    name: Mapped[str] = mapped_column(String(128))
    port: Mapped[int] = mapped_column(Integer)
    external_port: Mapped[int] = mapped_column(Integer, default=0)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    # M8 per-key limits; 0 = unlimited. quota_tokens per quota_period (day|month|"")
    rpm_limit: Mapped[int] = mapped_column(Integer, default=0)
    tpm_limit: Mapped[int] = mapped_column(Integer, default=0)
    quota_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    quota_period: Mapped[str] = mapped_column(String(16), default="")
    created_by: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class ModelRoute(Base):
    __tablename__ = "model_routes"
    # one route of a model name to a group per tenant (0015): the database refuses a
    # second, whoever writes it at the same moment
    __table_args__ = (
        Index("uq_route_tenant_model_group", "tenant_id", "model_name", "group_id", unique=True),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    group_id: Mapped[str] = mapped_column(String(32), index=True)
    model_name: Mapped[str] = mapped_column(String(256))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    weight: Mapped[int] = mapped_column(Integer, default=100)
    version: Mapped[str] = mapped_column(String(64), default="v1")
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    algorithm: Mapped[str] = mapped_column(String(32), default="round_robin")
    # capability tags for model=auto (M10), e.g. ["code", "long-context"]
    tags: Mapped[list[Any]] = mapped_column(default=list)
    # added through the API for the tenant (not created with its group): every key of
    # the tenant may call it, not only the keys of the group's endpoint
    added: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class Event(Base):
    """One row per state transition (and other facts worth a timeline entry)."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    group_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    task_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    kind: Mapped[str] = mapped_column(String(64))  # a core.events.EventKind value
    from_status: Mapped[str] = mapped_column(String(32), default="")
    to_status: Mapped[str] = mapped_column(String(32), default="")
    message: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime]
    # the node a fault concerns (node_lost / node_back / gpu_lost / task faults; 0009)
    node_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)


class TaskLog(Base):
    """Append-only chunks of a task's output (C6), numbered per task from 1.

    Only the newest ``task_log_max_bytes`` per task are kept: older chunks are trimmed
    when a new one arrives.
    """

    __tablename__ = "task_logs"
    __table_args__ = (Index("ix_task_logs_task_seq", "task_id", "seq", unique=True),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(32))
    seq: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(Integer)  # UTF-8 length of text
    created_at: Mapped[datetime]


class FileRequest(Base):
    """A user's request to list a directory or download a file on a task's node (C7).

    Kept in the database (with its chunks) so every server instance can answer for it.
    """

    __tablename__ = "file_requests"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(32), index=True)
    tenant_id: Mapped[str] = mapped_column(String(32), index=True)
    requested_by: Mapped[str] = mapped_column(String(32))
    request_type: Mapped[str] = mapped_column(String(16))  # list | download
    target_path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending|running|done|failed
    error: Mapped[str] = mapped_column(Text, default="")
    result: Mapped[dict[str, Any]] = mapped_column(default=dict)  # list: {"entries": [...]}
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class ModelRequest(Base):
    """An operator's pull or eviction of a model on one node's cache (issue 29), claimed
    by that node's agent through its poll; kept in the database so every server instance
    can answer for it."""

    __tablename__ = "model_requests"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(32), index=True)
    action: Mapped[str] = mapped_column(String(16))  # pull | evict
    source: Mapped[str] = mapped_column(Text, default="")  # pull: the model source
    key: Mapped[str] = mapped_column(String(128), default="")  # evict: the cache key
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending|running|done|failed
    message: Mapped[str] = mapped_column(Text, default="")
    done_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    requested_by: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class FileRequestChunk(Base):
    """One uploaded piece of a download, in order of ``seq`` (0, 1, ...)."""

    __tablename__ = "file_request_chunks"
    request_id: Mapped[str] = mapped_column(
        ForeignKey("file_requests.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class UsageRecord(Base):
    """Token usage (M7, N4), appended by the gateway in batches: one row per flush per
    (endpoint, model). Reports sum them; the endpoint gives the key, tenant and member.
    """

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_tenant_time", "tenant_id", "recorded_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    recorded_at: Mapped[datetime]
    endpoint_id: Mapped[str] = mapped_column(String(32), index=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    user_id: Mapped[str] = mapped_column(String(32))  # the member who created the key
    # the key's service when written (0020): it outlives the endpoint, deleted with it
    group_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    model_name: Mapped[str] = mapped_column(String(256))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class GpuTimeSegment(Base):
    """GPU time (N4): a stretch a task held its cards in one metered state, with the
    commitment it held then; open while ``ended_at`` is NULL (0014).

    ``state`` is ``running`` (booked and awake: scheduled, starting, running, waking,
    stopping) or ``sleeping``. ``card_pct`` is the commitment in hundredths of a card
    (``core.quotas.task_usage``; 0 for CPU work, which still records its task time).
    """

    __tablename__ = "gpu_time_segments"
    __table_args__ = (
        Index("ix_gpu_time_task", "task_id", "ended_at"),
        Index("ix_gpu_time_tenant_start", "tenant_id", "started_at"),
        Index("ix_gpu_time_start", "started_at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(32))
    group_id: Mapped[str] = mapped_column(String(32))
    tenant_id: Mapped[str] = mapped_column(String(32))
    user_id: Mapped[str] = mapped_column(String(32))  # the task's owner (created_by)
    node_id: Mapped[str] = mapped_column(String(32), default="")
    state: Mapped[str] = mapped_column(String(16))  # running | sleeping
    card_pct: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True, default=None)


class Lease(Base):
    """A named lease (leader election, services/leadership.py; migration 0008).

    ``epoch`` grows by one each time a different holder takes the lease and never goes
    back: it is the fencing token every leader-only write carries.
    """

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)  # e.g. "controllers"
    holder: Mapped[str] = mapped_column(String(64))  # a server instance id
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime]
    acquired_at: Mapped[datetime]  # when this holder took it (renewals keep it)
    renewed_at: Mapped[datetime]


class ServerInstance(Base):
    """One running ``heteroflow server`` process; heartbeats its row at every lease renew."""

    __tablename__ = "server_instances"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # new at every start
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    address: Mapped[str] = mapped_column(String(255), default="")  # "" until it listens
    port: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[str] = mapped_column(String(64), default="")
    started_at: Mapped[datetime]
    last_seen_at: Mapped[datetime] = mapped_column(index=True)


class RegistryCredential(Base):
    """A login for pulling private images from one registry (H7, 0016).

    ``tenant_id`` "" is the platform's own (an operator's), used for a tenant that has
    none of its own for that registry. The password is sealed; nothing reads it back
    out of the API.
    """

    __tablename__ = "registry_credentials"
    __table_args__ = (
        UniqueConstraint("tenant_id", "registry_host", name="uq_registry_credential"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), default="")
    registry_host: Mapped[str] = mapped_column(String(255))  # host[:port]
    username: Mapped[str] = mapped_column(String(255))
    password_sealed: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class HubToken(Base):
    """A tenant's token for a model hub (issue 29 item 1, H9, 0018).

    ``tenant_id`` "" is the platform's own (an operator's), used for a tenant that has
    none of its own for that hub; neither: the server's or node's ``hub_token`` setting.
    The token is sealed; ``token_hint`` (its last characters, "hf_…abcd") is all a read
    shows, so an admin can tell which token is set without anything reading it back.
    """

    __tablename__ = "hub_tokens"
    __table_args__ = (UniqueConstraint("tenant_id", "hub", name="uq_hub_token"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), default="")
    hub: Mapped[str] = mapped_column(String(16))  # core.model_sources.SourceKind: hf | modelscope
    token_sealed: Mapped[str] = mapped_column(Text)
    token_hint: Mapped[str] = mapped_column(String(16), default="")
    created_by: Mapped[str] = mapped_column(String(32), default="")
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class SeriesPoint(Base):
    """One point of a live time series (issue 33, 0019; ``core/series.py``): a service,
    a node or a card (``scope``, ``key``), at one resolution (``step``: 10 or 60 s), the
    bucket starting ``at``; ``values`` maps metric names to numbers (a minute point also
    holds each metric's sample count as ``#name``). Bounded: the sampler deletes points
    past their resolution's window (1 h raw, 24 h minutes) every round."""

    __tablename__ = "series_points"
    # the prune's index: every round deletes by (step, at) across all series
    __table_args__ = (Index("ix_series_points_step_at", "step", "at"),)
    scope: Mapped[str] = mapped_column(String(8), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(primary_key=True)
    values: Mapped[dict[str, Any]] = mapped_column(default=dict)
