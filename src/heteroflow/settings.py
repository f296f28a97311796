"""Settings for every process, read from the environment (prefix ``HETEROFLOW_``).

Every interval and timeout carries its unit in its name (``_s``) and is shortened by
the tests; nothing else in the code hard-codes a duration.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from heteroflow.core.containers import DEFAULT_ENV_ALLOW
from heteroflow.core.placement import Policy, Reservation, parse_scorers
from heteroflow.core.rollout import RolloutPolicy  # issue 14


def default_data_dir() -> Path:
    return Path.home() / ".heteroflow"


class LogSettings(BaseSettings):
    """How every process logs (issue 18, P3): HETEROFLOW_LOG_FORMAT=text (default) | json."""

    model_config = SettingsConfigDict(env_prefix="HETEROFLOW_", extra="ignore")

    log_format: Literal["text", "json"] = "text"


class ServerSettings(BaseSettings):
    """The control plane: API, controllers, the routing snapshot and (all-in-one) gateway."""

    model_config = SettingsConfigDict(env_prefix="HETEROFLOW_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    # SQLAlchemy URL; empty = SQLite (WAL) file in data_dir.
    database_url: str = ""
    host: str = "127.0.0.1"
    port: int = 3333
    # Secret that signs JWTs; empty = generated once and kept in the database
    # (platform_settings), so every server instance agrees; `heteroflow rotate-jwt-secret`.
    jwt_secret: str = ""
    jwt_ttl_s: float = 12 * 3600
    # Issue 29 (H9): a model source (hf://, modelscope://, https://) is resolved at create
    # and dry run against these hubs (the operator's mirror); hub_token (the platform's,
    # for every tenant: per-tenant tokens are not built yet) is sent to the hubs only.
    # The agents have their own (HETEROFLOW_AGENT_HF_ENDPOINT ...): they fetch.
    hf_endpoint: str = "https://huggingface.co"
    modelscope_endpoint: str = "https://www.modelscope.cn"
    hub_token: SecretStr = SecretStr("")
    model_resolve_timeout_s: float = Field(default=15.0, gt=0.0)
    admin_password: str = ""
    # Shared secret an agent presents to register and heartbeat (the node token); empty =
    # generated once and kept in the database, rotated by `heteroflow rotate-node-token`.
    node_token: str = ""
    # issue 18: during a rotation of a node token set here, the previous value (still
    # accepted until it is unset); the stored tokens' copy is re-read this often.
    node_token_previous: str = ""
    node_token_cache_s: float = Field(default=2.0, ge=0.0)
    # issue 18: TLS on the server's own port (API, agents, /v1): a PEM certificate
    # (chain) and its key; both or neither. Else plain HTTP (TLS in front of it).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Token a separate gateway presents to read the routing snapshot.
    gateway_token: str = ""
    # Login throttling, per user name and per client address, shared by every instance
    # (core/auth_policy.py): after 5 failures a key is blocked for base * 2^(failures-5)
    # seconds, at most login_backoff_max_s; a key quiet for login_throttle_forget_s
    # starts again from zero.
    login_backoff_base_s: float = Field(default=1.0, gt=0.0)
    login_backoff_max_s: float = Field(default=900.0, gt=0.0)
    login_throttle_forget_s: float = Field(default=24 * 3600.0, gt=0.0)
    # How long a server instance trusts its copy of the JWT secret from the database:
    # `heteroflow rotate-jwt-secret` reaches every instance within this time.
    jwt_secret_cache_s: float = Field(default=2.0, ge=0.0)

    scheduler_interval_s: float = 1.0
    # issue 18 (P3): /metrics reads nodes and tasks by status from the database at most
    # this often (scrapes in between get the last counts).
    metrics_fleet_refresh_s: float = Field(default=5.0, ge=0.0)
    snapshot_interval_s: float = 0.5
    node_offline_after_s: float = 20.0
    # Leader election (services/leadership.py): the leader-only loops run on the instance
    # holding the "controllers" lease. Every instance tries to take or renew it every
    # leader_renew_interval_s (shorter than the TTL, best at most a third of it: two
    # renewals may then fail before the lease lapses); a dead leader's lease is taken
    # over within leader_lease_ttl_s plus one renew interval.
    leader_lease_ttl_s: float = Field(default=15.0, gt=0.0)
    leader_renew_interval_s: float = Field(default=5.0, gt=0.0)
    # --- issue 13: the recovery loop (E1-E4, A10; services/lifecycle/recovery.py, leader-only) ---
    # Every recovery_interval_s it rebuilds failed tasks of groups meant to run, at most
    # recovery_max_rebuilds in a row (the count starts again once the task it replaces had
    # run recovery_stable_s); after recovery_fallback_after failed starts in a row of one
    # engine on one node it takes the next engine of the group's template chain (E3).
    # Tasks on a node lost (no heartbeat for node_offline_after_s) for node_migrate_after_s
    # more, or on a card gone from its node's inventory that long, are failed there and so
    # rebuilt elsewhere (E4). The same loop stops training / container tasks past their
    # group's run_timeout_seconds (A10).
    recovery_interval_s: float = Field(default=1.0, gt=0.0)
    recovery_max_rebuilds: int = Field(default=5, ge=0, le=100)
    recovery_stable_s: float = Field(default=60.0, ge=0.0)
    recovery_fallback_after: int = Field(default=2, ge=1, le=100)
    node_migrate_after_s: float = Field(default=60.0, ge=0.0)
    # When no node heartbeats, or this share of them (and at least two) is lost at once,
    # the loss is taken for the control plane's (a stalled server, a network split) and
    # work is not moved off the lost nodes until the share drops (core.recovery).
    node_disruption_threshold: float = Field(default=0.55, gt=0.0, le=1.0)
    # --- end issue 13 (recovery) ---
    # --- issue 14: rolling update and recreate (J1-J4; core/rollout.py) ---
    # A rollout's execution lease (J4): taken by the PUT .../update that starts it (in the
    # same compare-and-set that bumps current_generation), renewed every rollout_renew_s
    # by the instance that holds it, lapsing rollout_lease_ttl_s after the last renewal,
    # held at most rollout_max_hold_s (then the rollout is given up). Each instance drives
    # the rollouts it holds every rollout_interval_s and, at start and every
    # rollout_scan_interval_s, fails those whose lease lapsed (their holder died).
    rollout_lease_ttl_s: float = Field(default=60.0, gt=0.0)
    rollout_renew_s: float = Field(default=15.0, gt=0.0)
    rollout_max_hold_s: float = Field(default=960.0, gt=0.0)
    rollout_interval_s: float = Field(default=1.0, gt=0.0)
    rollout_scan_interval_s: float = Field(default=30.0, gt=0.0)
    # A batch's new replicas must be running (first health check passed) within
    # rollout_ready_timeout_s, else the attempt failed: tried again rollout_batch_retries
    # times, then the update rolls back. They run rollout_settle_s before the old replicas
    # drain (the gateways learn the new backends: snapshot_interval_s plus a separate
    # gateway's poll). A draining replica stops once the gateways report nothing in
    # flight on it, no sooner than rollout_drain_min_s (every gateway has seen the mark)
    # and no later than rollout_drain_timeout_s (without any report: that long).
    rollout_ready_timeout_s: float = Field(default=300.0, gt=0.0)
    rollout_batch_retries: int = Field(default=3, ge=0, le=10)
    rollout_settle_s: float = Field(default=2.0, ge=0.0)
    rollout_drain_min_s: float = Field(default=2.0, ge=0.0)
    rollout_drain_timeout_s: float = Field(default=30.0, ge=0.0)
    # An update with no batch switched for rollout_progress_deadline_s (since it started
    # or its last switch) fails at once with the reason it is stuck — a new replica the
    # scheduler cannot place, or never healthy — rolls back and frees the group for the
    # next update (issue 26); keep it below rollout_max_hold_s, which gives up unrolled.
    rollout_progress_deadline_s: float = Field(default=600.0, gt=0.0)
    # D5: a new replica whose agent said within rollout_load_news_s that it is loading (or
    # pulling its image) is making progress — its agent notes how far every few seconds
    # and fails a load that stalls — so neither limit above counts it (core/rollout/readiness.py)
    rollout_load_news_s: float = Field(default=60.0, gt=0.0)
    # --- end issue 14 (rollout) ---
    # VRAM kept free on every card (B3): fixed MB + a share of the card.
    vram_reserve_fixed_mb: int = 500
    vram_reserve_ratio: float = 0.10
    # B1: nodes busier than this (CPU or memory %) get no new work; inference
    # containers per node (sleeping services count).
    load_threshold_pct: float = 90.0
    inference_containers_per_node: int = 8
    # Scoring plugins and weights, e.g. "binpack:1,topology:1,rdma:1" or "spread:1";
    # nodes that must pass the filters before the best is chosen; preemption on/off;
    # scheduler workers (threads; each claims disjoint queued tasks on PostgreSQL).
    scheduler_scorers: str = "binpack:1,topology:1,rdma:1"
    scheduler_sample: int = Field(default=4, ge=1)
    scheduler_preemption: bool = True
    # issue 29: the nominal rate (MB/s) a node downloads a model source at: the dry run's
    # estimate of what a start on a node without a copy adds (placement prefers a holder)
    model_download_mb_s: float = Field(default=100.0, gt=0, allow_inf_nan=False)
    scheduler_workers: int = Field(default=1, ge=1, le=32)
    # Host ports given to tasks whose mapping says host_port 0.
    port_pool_start: int = 20000
    port_pool_end: int = 29999

    models_cache_ttl_s: float = 30.0
    upstream_timeout_s: float = 600.0
    # A separate gateway's snapshot poll; with snapshot_interval_s it bounds how fast a
    # deleted key stops working (0.5 + 1.0 s < the 2 s promise).
    gateway_poll_interval_s: float = 1.0
    # M8/M9: per-key limits and idempotency keys shared by every gateway instance through
    # this Redis (redis://host:6379/0); empty = in this process's memory (one instance).
    redis_url: str = ""
    redis_key_prefix: str = "hf:"
    # Gateway routing (M2, M4, M5, M10): backends on cards hotter than this are avoided
    # while a cooler one exists; active probes (GET /health) of every backend; engine
    # metrics scrapes of engine_aware backends (at most 250 ms apart); model=auto prefers
    # long-context models above this estimated prompt size (characters / 4).
    gateway_max_card_temp_c: float = 85.0
    gateway_probe_interval_s: float = 2.0
    gateway_probe_timeout_s: float = 1.0
    gateway_scrape_interval_s: float = Field(default=0.25, gt=0.0, le=0.25)
    gateway_auto_long_prompt_tokens: int = 4096
    # prefix_affinity (M15): a replica holding a request's prompt prefix takes it while
    # it has fewer than (least in flight on the route + this) requests in flight, or is
    # under 1.25 x the route's mean: a spill costs a whole prefill elsewhere (and evicts
    # what that replica held), so it waits for a real queue, not one request more.
    gateway_prefix_slack: int = Field(default=4, ge=1, le=10_000)
    # The event loop of a `heteroflow gateway` process (each worker): "asyncio" (the stock
    # one) or "uvloop" (libuv's, in C; uvicorn[standard] installs it). Measured on one core
    # (docs/benchmarks.md): uvloop spends 8 % less CPU per request and 14 % less per
    # stream, but its tail under saturation is worse (wrk c=32 p99 +6 ms, c=450 a max of
    # 0.9 s) and a burst of new connections lands on one worker: not the default.
    gateway_event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    # A request whose backend connection could not be made (nothing was sent) goes to
    # this many other healthy backends of its route; never after a byte was sent.
    gateway_connect_retries: int = Field(default=1, ge=0, le=3)
    # A request whose engine closed or reset the connection before any byte of an answer
    # (it died holding the request) goes once to another healthy backend of its route,
    # within what is left of upstream_timeout_s; false: answered 502 (gateway.retry).
    gateway_retry_unanswered: bool = True
    # Browser origins that may call /v1 (CORS, issue 15): empty = CORS off (browsers
    # block cross-origin calls), "*" = any origin. From the environment as a
    # comma-separated list: HETEROFLOW_GATEWAY_CORS_ORIGINS=https://app.example.com,...
    gateway_cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Token usage (M7): the gateway writes its sums every usage_flush_interval_s, or
    # sooner once usage_flush_max_records requests were counted.
    usage_flush_interval_s: float = 5.0
    usage_flush_max_records: int = 10_000
    # A standalone gateway (--routes FILE) checks the file's mtime this often (and
    # reloads at once on SIGHUP).
    routes_reload_interval_s: float = 1.0

    # Idle sleep and wake on request (F4, F6). The leader puts to sleep, every
    # idle_check_interval_s, each service whose gateway traffic stopped for its
    # idle_timeout_minutes (idle_minute_s is one such minute: 60; tests shorten it). A
    # request for a sleeping model wakes it and is held until a backend is up, at most
    # gateway_wake_hold_s (0 = no holding: 503 at once, the wake started); a 503 says
    # Retry-After: gateway_wake_retry_after_s. While requests are held the gateway
    # re-reads the routing snapshot every gateway_wake_poll_s. A request for a model
    # whose replicas are starting (M17: none up yet) is held likewise, at most
    # gateway_start_hold_s (0 = 503 at once): shorter, since a first start may pull and
    # load for minutes — its 503 says how long the replicas have been starting.
    idle_check_interval_s: float = Field(default=15.0, gt=0.0)
    # Live series (issue 33): the leader samples every series_interval_s (the raw
    # points' 10 s resolution; shorter only in tests: two samples in one 10 s bucket
    # keep the latest)
    series_interval_s: float = Field(default=10.0, gt=0.0, le=60.0)
    idle_minute_s: float = Field(default=60.0, gt=0.0)
    gateway_wake_hold_s: float = Field(default=120.0, ge=0.0)
    gateway_start_hold_s: float = Field(default=30.0, ge=0.0)
    gateway_wake_retry_after_s: int = Field(default=10, ge=1, le=3600)
    gateway_wake_poll_s: float = Field(default=0.2, gt=0.0)

    # Fair share under overload (M16, gateway/routing/fair_share.py). A route's pool is
    # saturated at gateway_backend_concurrency requests in flight per usable backend (0 = off:
    # no gate, the engines queue; set it to the engine's slots: llama.cpp --parallel, vLLM
    # --max-num-seqs) — a backend whose engine's arguments set its slots counts those instead
    # (Backend.slots, registry.engine_slots). Beyond it requests wait in per-tenant queues
    # served by weighted fair queueing (gateway_fair_share_weights: {"tenant id": weight},
    # default 1; gateway_fair_share_priority_tenants served first), at most
    # gateway_fair_share_max_queue per tenant and pool (then 429 rate_limit_exceeded) and at
    # most gateway_fair_share_max_wait_s (then 503 server_overloaded); both say Retry-After:
    # gateway_fair_share_retry_after_s. While another tenant used the pool within
    # gateway_fair_share_linger_s, a tenant holds at most its weighted share of the bound (the
    # rest stays free for the others' next requests; 0 = lend every free slot). With --workers N
    # each worker gates ceil(bound / N).
    gateway_backend_concurrency: int = Field(default=0, ge=0, le=100_000)
    gateway_fair_share_max_queue: int = Field(default=64, ge=0, le=1_000_000)
    gateway_fair_share_max_wait_s: float = Field(default=30.0, ge=0.0)
    gateway_fair_share_retry_after_s: int = Field(default=2, ge=1, le=3600)
    gateway_fair_share_weights: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=dict
    )
    gateway_fair_share_priority_tenants: list[str] = Field(default_factory=list)
    gateway_fair_share_linger_s: float = Field(default=30.0, ge=0.0)

    # --- issue 14: scaling (I1, I2; core/autoscale.py, services/lifecycle/scaling.py) ---
    # The leader's autoscaler decides every autoscale_interval_s for each service whose
    # scale_policy is enabled; a replica younger than autoscale_min_age_s (from running_at)
    # is never scaled down. A replica a scale-in takes away drains first (no new request)
    # and stops once every gateway reports nothing in flight on it, or after
    # scale_drain_timeout_s; the leader looks every scale_drain_interval_s. Gateways send
    # their load (in flight, tokens/s, the engines' queue and KV use) with every usage
    # flush; a report older than gateway_load_stale_s is ignored (that gateway counts as
    # gone). Gateways scrape the engines' /metrics for it every
    # gateway_load_scrape_interval_s (0 = never: the queue and kv_cache metrics then
    # have no data), besides engine_aware routing's own scrapes.
    autoscale_interval_s: float = Field(default=30.0, gt=0.0)
    autoscale_min_age_s: float = Field(default=60.0, ge=0.0)
    scale_drain_timeout_s: float = Field(default=300.0, ge=0.0)
    scale_drain_interval_s: float = Field(default=1.0, gt=0.0)
    gateway_load_stale_s: float = Field(default=20.0, gt=0.0)
    gateway_load_scrape_interval_s: float = Field(default=5.0, ge=0.0)
    # --- end issue 14 (scaling) ---

    # Sleep and wake (F1-F3, services/lifecycle/sleep.py). A wake that cannot happen now (node
    # offline, cards borrowed by training) is recorded as wake_requested; the leader's
    # wake retrier looks at those every wake_retry_interval_s: it wakes the task once it
    # can, and fails it (the recovery loop then rebuilds it elsewhere) once its node has
    # had no heartbeat for wake_node_lost_after_s — likewise a task waking on such a node.
    # How long a woken engine may take to pass its health check follows its load on the
    # node (D5: the agent's HETEROFLOW_AGENT_LOAD_STALL_S and LOAD_CEILING_S).
    wake_retry_interval_s: float = Field(default=2.0, gt=0.0)
    wake_node_lost_after_s: float = Field(default=120.0, gt=0.0)
    # --- issue 14: schedule windows (K1, services/lifecycle/windows.py; leader-only). Every
    # schedule_window_interval_s the leader acts on each service's window: outside it,
    # its action (pause / scale / stop); back inside, or disabled, undone (but a stop). ---
    schedule_window_interval_s: float = Field(default=60.0, gt=0.0)

    # Task logs (C6): the newest bytes kept per task (oldest chunks are trimmed), the
    # most one agent call may append, and the live view's poll interval and duration.
    task_log_max_bytes: int = 8 * 1024 * 1024
    log_append_max_bytes: int = 1024 * 1024
    log_follow_poll_s: float = 0.5
    log_follow_timeout_s: float = 3600.0
    # File requests (C7): one uploaded chunk at most, one download at most, and how
    # long a request may sit pending or running without progress before it fails.
    file_chunk_bytes: int = 64 * 1024 * 1024
    file_request_max_bytes: int = 4 * 1024 * 1024 * 1024
    file_request_timeout_s: float = 600.0
    # Audit log (api/audit_middleware.py): rows older than this many days are deleted
    # (0 = kept forever), swept at most once per audit_prune_interval_s per instance.
    audit_retention_days: int = Field(default=90, ge=0, le=36500)
    audit_prune_interval_s: float = Field(default=3600.0, gt=0.0)

    # Variables a task's env may set besides the defaults (core.containers
    # DEFAULT_ENV_ALLOW): names or PREFIX* patterns, comma-separated. The deny-list
    # (loader, interpreter hooks, proxies, HETEROFLOW_*) cannot be lifted.
    task_env_allow: str = ""

    def reservation(self) -> Reservation:
        return Reservation(self.vram_reserve_fixed_mb, self.vram_reserve_ratio)

    def env_allow(self) -> tuple[str, ...]:
        extra = tuple(p.strip() for p in self.task_env_allow.split(",") if p.strip())
        return (*DEFAULT_ENV_ALLOW, *extra)

    @field_validator("scheduler_scorers")
    @classmethod
    def _known_scorers(cls, v: str) -> str:
        parse_scorers(v)  # ValueError names the bad scorer
        return v

    @field_validator("gateway_cors_origins", mode="before")
    @classmethod
    def _origin_list(cls, v: object) -> object:
        """A comma-separated string (the environment's form) as a list of origins."""
        if isinstance(v, str):
            return [o.strip() for o in v.split(",") if o.strip()]
        return v

    @field_validator("tls_cert_file", "tls_key_file", mode="before")
    @classmethod
    def _no_empty_path(cls, v: object) -> object:  # issue 18: FILE= in an env file
        return None if v == "" else v

    @model_validator(mode="after")
    def _pairs(self) -> ServerSettings:  # issue 18
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("HETEROFLOW_TLS_CERT_FILE and HETEROFLOW_TLS_KEY_FILE go together")
        if self.node_token_previous and not self.node_token:
            raise ValueError("HETEROFLOW_NODE_TOKEN_PREVIOUS needs HETEROFLOW_NODE_TOKEN")
        return self

    def placement_policy(self) -> Policy:
        return Policy(
            self.load_threshold_pct,
            self.inference_containers_per_node,
            scorers=parse_scorers(self.scheduler_scorers),
            sample=self.scheduler_sample,
            preemption=self.scheduler_preemption,
            download_mb_s=self.model_download_mb_s,
        )

    def port_pool(self) -> range:
        return range(self.port_pool_start, self.port_pool_end + 1)

    def sqlite_path(self) -> Path:
        return self.data_dir / "heteroflow.db"

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.sqlite_path()}"

    def rollout_policy(self) -> RolloutPolicy:  # issue 14 (J1-J4)
        return RolloutPolicy(
            ready_timeout_s=self.rollout_ready_timeout_s,
            settle_s=self.rollout_settle_s,
            drain_min_s=self.rollout_drain_min_s,
            drain_timeout_s=self.rollout_drain_timeout_s,
            batch_retries=self.rollout_batch_retries,
            lease_ttl_s=self.rollout_lease_ttl_s,
            renew_s=self.rollout_renew_s,
            max_hold_s=self.rollout_max_hold_s,
            progress_deadline_s=self.rollout_progress_deadline_s,
            load_news_s=self.rollout_load_news_s,
        )


# Agent settings that were retired: set, they would do nothing, silently. The agent warns
# at start, one line each naming what replaced it (``retired_agent_settings``).
RETIRED_AGENT_SETTINGS: dict[str, str] = {
    # D5 (issue 28): a wake is judged by its load, like a launch, not by a fixed limit
    "wake_ready_timeout_s": (
        "a wake now follows its load (D5): set HETEROFLOW_AGENT_LOAD_STALL_S (no progress "
        "for this long stops it, 120 s) and HETEROFLOW_AGENT_LOAD_CEILING_S (its most, "
        "3600 s) instead"
    ),
}


def retired_agent_settings(environ: Mapping[str, str]) -> list[str]:
    """One warning line per retired agent setting ``environ`` still sets (any case)."""
    names = {k.upper() for k in environ}
    out = []
    for name, instead in RETIRED_AGENT_SETTINGS.items():
        var = f"HETEROFLOW_AGENT_{name.upper()}"
        if var in names:
            out.append(f"{var} is set but no longer read (ignored): {instead}")
    return out


class AgentSettings(BaseSettings):
    """One node daemon."""

    model_config = SettingsConfigDict(env_prefix="HETEROFLOW_AGENT_", extra="ignore")

    server_url: str = "http://127.0.0.1:3333"
    node_token: str = ""
    # issue 18: a CA bundle (PEM) an https server_url's certificate is verified against
    # (instead of the default bundle); empty = the default (certifi's, or SSL_CERT_FILE).
    ca_file: Path | None = None
    node_name: str = ""
    # Address the gateway uses to reach engines on this node; 127.0.0.1 on a single node.
    address: str = "127.0.0.1"
    # JSON/TOML-free config file (JSON) with declared cards, volume allow/deny prefixes.
    config_file: Path | None = None
    work_dir: Path = Field(default_factory=lambda: default_data_dir() / "agent")

    # docker: engines as containers (production); process: child processes (no Docker)
    runtime: Literal["docker", "process"] = "docker"
    # Docker Engine socket; empty = DOCKER_HOST or the default socket
    docker_host: str = ""
    # Stop the engines when the agent exits (the process runtime always does: its
    # engines are its children). Containers normally outlive an agent restart (C2).
    stop_engines_on_exit: bool = False

    heartbeat_interval_s: float = 5.0
    # How often engines are checked for exit and due health probes (each check has its
    # own interval_seconds; this is only the resolution of the watcher).
    watch_interval_s: float = 0.2
    request_timeout_s: float = 10.0
    stop_timeout_s: float = 10.0
    # A port-bind conflict at launch is retried with back-off for this long (C11).
    port_retry_total_s: float = 119.0
    # H7: an image pull (Docker runtime) ends within image_pull_timeout_s (30 min: a
    # 20 GB image at 15 MB/s); its progress is noted on the task at most every
    # image_pull_report_interval_s (the status message; events at its start and end)
    image_pull_timeout_s: float = Field(default=1800.0, gt=0.0)
    image_pull_report_interval_s: float = Field(default=2.0, gt=0.0)
    # Issue 29 (H9): a task whose model_path is a source (hf://, modelscope://, https://)
    # has its model fetched into this node's cache first (agent/fetching.py): one copy per
    # resolved revision in model_cache_dir (empty = <work_dir>/models), least recently used
    # models no task uses evicted to stay within model_cache_budget_gb (0 = no budget).
    # The hubs are the operator's (a mirror); hub_token is sent to the Hugging Face
    # endpoint (or ModelScope's, as its cookie) for every task of this node — per-tenant
    # tokens are not built yet. Progress is noted like an image pull's.
    model_cache_dir: Path | None = None
    model_cache_budget_gb: float = Field(default=0.0, ge=0.0)
    hf_endpoint: str = "https://huggingface.co"
    modelscope_endpoint: str = "https://www.modelscope.cn"
    hub_token: SecretStr = SecretStr("")
    model_resolve_timeout_s: float = Field(default=30.0, gt=0.0)
    # Issue 29: copies between nodes. With peer_port set (0 = any free port) the agent
    # serves its complete cached models to the other agents on peer_host (empty = its
    # address), signed requests only (the node token; none = not served), over TLS with
    # peer_tls_cert/peer_tls_key (the copying agent verifies against its ca_file). A node
    # that needs a model another node holds copies it from there before it asks the
    # origin. Off by default: a port open on every node is the operator's decision
    # (deploy/ turns it on, 3469).
    peer_port: int | None = Field(default=None, ge=0, le=65535)
    peer_host: str = ""
    peer_tls_cert: Path | None = None
    peer_tls_key: Path | None = None
    # Engine threads for CPU llama.cpp; 0 = let the launcher choose.
    cpu_threads: int = 0
    # The process runtime runs vLLM only on a Python that has it (a venv with vLLM's CPU
    # build, as scripts/_venv.sh ensure_vllm makes, or a GPU build); empty = no vLLM here.
    vllm_python: str = ""
    # Logs (C6): how often new output is shipped and the most lines read per round.
    log_ship_interval_s: float = 2.0
    log_tail_lines: int = 2000
    # File requests (C7): upload chunk size; at most the server's file_chunk_bytes.
    file_chunk_bytes: int = 64 * 1024 * 1024
    # Sleep and wake (F1, F2). While the agent runs or holds asleep inference engines it
    # asks the server every task_life_poll_interval_s which of its tasks sleep or wake,
    # and converges at once rather than at the next heartbeat (0 = heartbeats only). A
    # vLLM-family engine gets POST /sleep?level=2 (at most vllm_sleep_timeout_s) before it
    # is stopped. A woken engine is judged like a launched one, by its load (D5, below).
    # An engine not yet serving (launched or woken) is probed every wake_probe_interval_s
    # inside its start period or its load window (failures there are not counted), so it
    # serves as soon as it answers; after its first pass its check's interval applies.
    # An engine started with vLLM's sleep mode (core.engines.sleep: vLLM on CUDA cards) is
    # kept asleep instead: POST /sleep?level=1 copies its weights to host memory (a 70B
    # model's 140 GB take a while), POST /wake_up copies them back; each may take up to
    # vllm_keep_timeout_s, then the engine is stopped (sleep) or started again (wake).
    task_life_poll_interval_s: float = Field(default=0.5, ge=0.0)
    vllm_sleep_timeout_s: float = Field(default=5.0, gt=0.0)
    vllm_keep_timeout_s: float = Field(default=300.0, gt=0.0)
    wake_probe_interval_s: float = Field(default=0.2, gt=0.0)
    # LoRA adapters (agent/adapters.py): each load or unload call to the engine waits at
    # most lora_load_timeout_s; a failed load is tried again after lora_retry_base_s,
    # doubling up to lora_retry_max_s (reported once per change, never a restart)
    lora_load_timeout_s: float = Field(default=60.0, gt=0.0)
    lora_retry_base_s: float = Field(default=5.0, gt=0.0)
    lora_retry_max_s: float = Field(default=300.0, gt=0.0)
    # Start and wake windows that follow loading (D5, agent/loading.py). Between its launch
    # (or wake) and its first passing health check an inference engine's failed checks are
    # not counted: it is judged by its load, sampled every load_sample_interval_s (the
    # bytes it read, its log, its own word). Stopped (fault.load_stalled, a failed start
    # for recovery and E3) once nothing moved for load_stall_s (never inside its start
    # period), or once it has loaded longer than max(load_ceiling_s, 3 x its expected
    # time) although it moves (0 = no ceiling). Its status message says how far it is
    # every load_report_interval_s; the expected time is the model's size over this
    # node's read rate, measured from the loads it has seen (load_default_read_mb_s, in
    # MB/s, before the first). After the first pass D2's rules apply unchanged.
    load_stall_s: float = Field(default=120.0, gt=0.0)
    load_sample_interval_s: float = Field(default=2.0, gt=0.0)
    load_report_interval_s: float = Field(default=10.0, gt=0.0)
    load_ceiling_s: float = Field(default=3600.0, ge=0.0)
    load_default_read_mb_s: float = Field(default=200.0, gt=0.0)
    # issue 18 (P3): GET /metrics (cards, engines, launches, heartbeats) on this port; unset
    # = off (0 = any free port). Loopback by default: a node's Prometheus, or a tunnel.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"

    @model_validator(mode="after")
    def _peer_tls_pair(self) -> AgentSettings:
        if (self.peer_tls_cert is None) != (self.peer_tls_key is None):
            raise ValueError("HETEROFLOW_AGENT_PEER_TLS_CERT and HETEROFLOW_AGENT_PEER_TLS_KEY "
                             "go together: both or neither")
        return self

    @field_validator("ca_file", "peer_tls_cert", "peer_tls_key", mode="before")
    @classmethod
    def _no_empty_path(cls, v: object) -> object:  # issue 18: FILE= in an env file
        return None if v == "" else v
