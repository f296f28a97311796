"""The OpenAI-compatible gateway: a raw ASGI3 app for the ``/v1`` paths.

Owns the request path of inference traffic, one step per module: the API key and the
body (``inbound``), the model and the backend (``router``: model=auto, access, the
session pin, ``balancing``; a sleeping model woken first or starting replicas waited
for, ``hold``), the request's
idempotency key and limits (``admission``), then the send, with failover to another
backend of the route when the chosen one provably did not answer, the relay of the
backend's answer and the request's settlement (``forward``, ``relay``). No framework
sits on this path, and nothing here logs per request at INFO, because the gateway's CPU
cost per request is its throughput limit (see bench/gateway: a bare relay costs
~0.2 ms/request).

Paths: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``POST /v1/responses``, ``GET /v1/models`` and ``GET /v1/models/{id}`` (``model_list``).
Anything else under ``/v1`` is an OpenAI-shaped 404 (or 405 for a known path with the
wrong method); ``OPTIONS`` (CORS preflights) and the headers every answer carries
(``x-request-id``, CORS) are ``http_conventions``'. ``GET /metrics`` is the gateway's
Prometheus text (``metrics``); every other request is counted there, whatever its path
and outcome.

Every usage flush carries this gateway's load (``load_report``, issue 14): per backend,
the requests in flight, the tokens/s it answered, the engine's queue and KV use, and
whether it drains — what the server's autoscaler scales by and what the drains of a
scale-in or a rolling update wait for.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence

from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from heteroflow.gateway.backend.engine_metrics import EngineLoad
from heteroflow.gateway.backend.forward import Forwarder
from heteroflow.gateway.backend.retry import DEFAULT_CONNECT_RETRIES
from heteroflow.gateway.backend.upstream import Upstream
from heteroflow.gateway.inbound import Exchange, as_chat, parse
from heteroflow.gateway.metrics import GatewayMetrics, path_label
from heteroflow.gateway.policy.admission import Admission
from heteroflow.gateway.policy.usage import HttpUsageSink, UsageCollector
from heteroflow.gateway.routing.auto import DEFAULT_LONG_PROMPT_TOKENS
from heteroflow.gateway.routing.balancing import (
    DEFAULT_MAX_TEMP_C,
    DEFAULT_PREFIX_SLACK,
    Balancer,
)
from heteroflow.gateway.routing.fair_gate import FairGate, FairShareSettings
from heteroflow.gateway.routing.fair_share import Pool
from heteroflow.gateway.routing.health import DEFAULT_COOLDOWN_S, PassiveHealth
from heteroflow.gateway.routing.hold import (
    DEFAULT_HOLD_S,
    DEFAULT_POLL_S,
    DEFAULT_RETRY_AFTER_S,
    DEFAULT_START_HOLD_S,
    HttpServerLink,
    RoutableHold,
    ServerLink,
)
from heteroflow.gateway.routing.inflight import InFlight, LocalInFlight
from heteroflow.gateway.routing.model_list import MODELS_PREFIX, list_models
from heteroflow.gateway.routing.probes import (
    DEFAULT_LOAD_SCRAPE_INTERVAL_S,
    DEFAULT_PROBE_INTERVAL_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_SCRAPE_INTERVAL_S,
    BackendMonitor,
)
from heteroflow.gateway.routing.router import Router
from heteroflow.gateway.routing.store import GatewayStore, MemoryStore, open_store
from heteroflow.gateway.shaping.responses import RESPONSES_PATH
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Receive, Scope, Send
from heteroflow.gateway.wire.http_conventions import REQUEST_ID_KEY, Conventions
from heteroflow.logs import REQUEST_ID
from heteroflow.schemas.routing import RoutingSnapshot, SnapshotHolder
from heteroflow.schemas.usage import BackendLoad, GatewayLoad
from heteroflow.settings import ServerSettings

_INFERENCE_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", RESPONSES_PATH}
)
_METRICS_PATH = "/metrics"


class GatewayApp:
    """ASGI3 callable for ``/v1``; mount it before any other app for that prefix."""

    def __init__(
        self,
        holder: SnapshotHolder,
        *,
        models_cache_ttl_s: float = 30.0,
        upstream_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        eject_cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_sessions: int = 10_000,
        usage: UsageCollector | None = None,
        metrics: GatewayMetrics | None = None,
        max_card_temp_c: float | None = DEFAULT_MAX_TEMP_C,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
        auto_long_prompt_tokens: int = DEFAULT_LONG_PROMPT_TOKENS,
        connect_retries: int = DEFAULT_CONNECT_RETRIES,
        retry_unanswered: bool = True,
        store: GatewayStore | None = None,
        clock: Clock | None = None,
        link: ServerLink | None = None,
        wake_hold_s: float = DEFAULT_HOLD_S,
        start_hold_s: float = DEFAULT_START_HOLD_S,
        wake_retry_after_s: int = DEFAULT_RETRY_AFTER_S,
        wake_poll_s: float = DEFAULT_POLL_S,
        load_scrape_interval_s: float = DEFAULT_LOAD_SCRAPE_INTERVAL_S,
        cors_origins: Sequence[str] = (),
        inflight: InFlight | None = None,
        fair_share: FairShareSettings | None = None,
        prefix_slack: int = DEFAULT_PREFIX_SLACK,
    ) -> None:
        self._holder = holder
        # issue 15: x-request-id, CORS (off without origins) on every /v1 answer
        self._conventions = Conventions(cors_origins)
        # issue 14: this gateway in the load reports (a new one at every start)
        self.gateway_id = f"gw-{secrets.token_hex(6)}"
        # M8 limits and M9 idempotency keys: in memory, or shared through Redis
        # (store.RedisStore); closed with the app.
        self._store: GatewayStore = store or MemoryStore()
        clock = clock or SystemClock()
        # issue 15: /v1/models' ``created`` (the snapshot carries no creation times)
        self._created = int(clock.now().timestamp())
        self._usage = usage  # None: tokens are counted for metrics (and limits) only
        self.metrics = metrics or GatewayMetrics()
        # what GET /metrics answers: this process's counts, or (a worker of several,
        # issue 31) the sum of every worker's (``metrics_share``)
        self.render_metrics: Callable[[], bytes] = self.metrics.render
        self._admission = Admission(
            self._store,
            clock,
            idempotency_lease_s=upstream_timeout_s + 60.0,
            usage=usage,
            metrics=self.metrics,
        )
        # F6: requests for a sleeping model wake it (through ``link``: the server) and
        # wait for it here; M17: so do requests for a model whose replicas are starting
        self.hold = RoutableHold(
            holder,
            link,
            self.metrics,
            hold_s=wake_hold_s,
            start_hold_s=start_hold_s,
            retry_after_s=wake_retry_after_s,
            poll_s=wake_poll_s,
            now=lambda: clock.now().timestamp(),
        )
        self._health = PassiveHealth(eject_cooldown_s)
        loads: dict[str, EngineLoad] = {}  # engine_aware: written by the monitor
        # issue 31: shared by the workers of ``heteroflow gateway --workers N``
        self._inflight: InFlight = LocalInFlight() if inflight is None else inflight
        self._balancer = Balancer(
            self._health,
            max_sessions=max_sessions,
            max_temp_c=max_card_temp_c,
            loads=loads,
            inflight=self._inflight,
            prefix_slack=prefix_slack,
        )
        # M5 active probes and M2 engine metrics; they follow the snapshot themselves
        # (never the request path) and start with the app (``start``)
        self._monitor = BackendMonitor(
            self._health,
            loads,
            self._balancer.in_flight_at,
            probe_interval_s=probe_interval_s,
            probe_timeout_s=probe_timeout_s,
            scrape_interval_s=scrape_interval_s,
            snapshot=lambda: holder.current,
            on_snapshot=self._follow,
            load_scrape_interval_s=load_scrape_interval_s,
        )
        if usage is not None:  # issue 14: the load goes with every usage flush
            usage.set_load_source(self.load_report)
        # M16: fair share of a saturated pool between tenants (off without a bound)
        fs = fair_share or FairShareSettings()
        self._fair = FairGate(
            self._balancer,
            self.metrics,
            per_backend=fs.per_backend,
            max_queue=fs.max_queue,
            max_wait_s=fs.max_wait_s,
            retry_after_s=fs.retry_after_s,
            now=clock.monotonic,
            weights=dict(fs.weights),
            priority=frozenset(fs.priority),
            linger_s=fs.linger_s,
            # --workers N: each of the processes taking requests gates its share
            workers=getattr(self._inflight, "serving", 1),
        )
        self._router = Router(
            self._balancer, self.hold, usage, auto_long_prompt_tokens=auto_long_prompt_tokens
        )
        self._upstream = Upstream(
            models_cache_ttl_s=models_cache_ttl_s,
            upstream_timeout_s=upstream_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        self._forwarder = Forwarder(
            self._upstream,
            self._balancer,
            self._health,
            self._admission,
            self.metrics,
            clock,
            connect_retries=connect_retries,
            retry_unanswered=retry_unanswered,
            upstream_timeout_s=upstream_timeout_s,
        )
        self._started = False

    @classmethod
    def from_settings(
        cls,
        settings: ServerSettings,
        holder: SnapshotHolder,
        *,
        usage: UsageCollector | None = None,
        clock: Clock | None = None,
        link: ServerLink | None = None,
        inflight: InFlight | None = None,
    ) -> GatewayApp:
        """The gateway as every process builds it (``up``, ``server`` and a separate
        ``heteroflow gateway``): every gateway setting in one place.

        ``link`` is how it asks its server for wakes (F6). A separate gateway that
        reports its usage to a server (``HttpUsageSink``) reaches the same server with
        the same token when none is given."""
        if link is None and usage is not None and isinstance(usage.sink, HttpUsageSink):
            link = HttpServerLink(usage.sink.server_url, usage.sink.token, holder)
        return cls(
            holder,
            usage=usage,
            models_cache_ttl_s=settings.models_cache_ttl_s,
            upstream_timeout_s=settings.upstream_timeout_s,
            max_card_temp_c=settings.gateway_max_card_temp_c,
            probe_interval_s=settings.gateway_probe_interval_s,
            probe_timeout_s=settings.gateway_probe_timeout_s,
            scrape_interval_s=settings.gateway_scrape_interval_s,
            auto_long_prompt_tokens=settings.gateway_auto_long_prompt_tokens,
            connect_retries=settings.gateway_connect_retries,
            retry_unanswered=settings.gateway_retry_unanswered,
            store=open_store(settings.redis_url, settings.redis_key_prefix),
            clock=clock,
            link=link,
            wake_hold_s=settings.gateway_wake_hold_s,
            start_hold_s=settings.gateway_start_hold_s,
            wake_retry_after_s=settings.gateway_wake_retry_after_s,
            wake_poll_s=settings.gateway_wake_poll_s,
            load_scrape_interval_s=settings.gateway_load_scrape_interval_s,
            cors_origins=settings.gateway_cors_origins,
            inflight=inflight,
            prefix_slack=settings.gateway_prefix_slack,
            fair_share=FairShareSettings(
                per_backend=settings.gateway_backend_concurrency,
                max_queue=settings.gateway_fair_share_max_queue,
                max_wait_s=settings.gateway_fair_share_max_wait_s,
                retry_after_s=settings.gateway_fair_share_retry_after_s,
                weights=settings.gateway_fair_share_weights,
                priority=tuple(settings.gateway_fair_share_priority_tenants),
                linger_s=settings.gateway_fair_share_linger_s,
            ),
        )

    def start(self) -> None:
        """Start the background work on the running event loop: the backend monitor,
        which also follows snapshot changes. The process roots call it at start-up."""
        self._started = True
        self._monitor.start()

    def _follow(self, snap: RoutingSnapshot) -> None:
        """A new snapshot: drop pooled connections to backends that left it."""
        self._upstream.retain(
            b.base_url for ts in snap.routes.values() for t in ts for b in t.backends
        )

    async def aclose(self) -> None:
        """Stop the backend monitor; close the upstream connection pool(s) and the store."""
        await self._monitor.aclose()
        await self.hold.aclose()
        await self._upstream.aclose()
        await self._store.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            if path == _METRICS_PATH:
                if scope["method"] == "GET":
                    await self._send_metrics(send)
                else:
                    await _not_allowed(send, scope["method"], path, b"GET")
                return
            # Every other request is counted, whatever its outcome (401, 404, 405, 429,
            # 5xx, 2xx) and path, under a bounded path label (``metrics.path_label``).
            ex = Exchange(send, self._conventions.begin(scope))
            # issue 18 (P3): every line logged for this request carries its id
            rid = REQUEST_ID.set(scope[REQUEST_ID_KEY])
            metrics = self.metrics
            metrics.in_flight += 1
            try:
                if scope["method"] != "OPTIONS" or not await self._conventions.answer_options(
                    scope, ex, _allowed_methods(path)
                ):
                    await self._dispatch(scope, receive, ex, path)
            finally:
                metrics.in_flight -= 1
                metrics.request_done(path_label(path), ex.model, ex.status)
                REQUEST_ID.reset(rid)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, ex: Exchange, path: str) -> None:
        method: str = scope["method"]
        if path in _INFERENCE_PATHS:
            if method == "POST":
                await self._proxy(scope, receive, ex, path)
            else:
                await _not_allowed(ex, method, path, b"POST")
        elif path == "/v1/models" or path.startswith(MODELS_PREFIX):
            if method == "GET":
                await list_models(self._holder.current, self._created, scope, ex, path)
            else:
                await _not_allowed(ex, method, path, b"GET")
        else:
            await errors.send_error(ex, errors.invalid_url(method, path))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send_metrics(self, send: Send) -> None:
        body = self.render_metrics()
        headers = [(b"content-type", METRICS_CONTENT_TYPE), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _proxy(self, scope: Scope, receive: Receive, send: Exchange, path: str) -> None:
        """auth → route → admit → relay → settle: each step answers the client itself
        when the request ends there (and says so by returning None / False)."""
        if not self._started:
            self.start()  # embedders that never called start(): the first request does
        started = time.monotonic()
        call = await parse(self._holder.current, scope, receive, send, path)
        if call is not None and path == RESPONSES_PATH and not await as_chat(call, send):
            return
        if call is None:
            return
        held: Pool | None = None
        try:
            if not await self._router.route(scope, receive, call, send, path):
                return
            slot = self._fair.enter(call)  # M16: None (off), a slot, or queued/refused
            if slot is not None and not isinstance(slot, Pool):
                slot = await self._fair.wait(slot, call, receive, send)
                if slot is None:  # answered (429, 503) or the client left
                    return
            held = slot
            if not await self._admission.admit(scope, call, send, path):
                return
            await self._forwarder.relay_and_settle(scope, receive, call, send, path)
        finally:
            if held is not None:
                self._fair.leave(held, call)  # a stream's slot is held until it ended
            if self._usage is not None:  # issue 33: the live series, answered or refused
                self._usage.answers.ended(call, send.status, started, send.first_at)

    def load_report(self) -> GatewayLoad:
        """Issue 14: every backend of the current snapshot as this gateway sees it —
        requests in flight through it, whether the snapshot says it drains, the tokens/s
        it answered (the usage collector's window), the engine's queue and KV use (the
        latest scrape). Backends without a group (a routes file's) are left out."""
        snap = self._holder.current
        rates = self._usage.token_rates if self._usage is not None else {}
        seen: set[str] = set()
        out: list[BackendLoad] = []
        capacity, now = self._balancer.capacity_view, time.monotonic()
        for targets in snap.routes.values():
            for target in targets:
                for b in target.backends:
                    if not b.group_id or b.task_id in seen:
                        continue
                    seen.add(b.task_id)
                    engine = self._monitor.load_of(b.base_url)
                    out.append(
                        BackendLoad(
                            task_id=b.task_id,
                            group_id=b.group_id,
                            draining=b.draining,
                            # this worker's own: the server sums the gateways' reports
                            in_flight=self._inflight.own(b.base_url),
                            tokens_per_s=rates.get(b.task_id, 0.0),
                            waiting=None if engine is None else engine.waiting,
                            kv_use=None if engine is None else engine.kv_use,
                            prefix=None if engine is None or engine.prefix_queries is None
                            else (engine.prefix_hits or 0.0, engine.prefix_queries),
                            ms_per_token=_ms_per_token(capacity.seconds_per_token(b.base_url, now)),
                            **(self._usage.answers.of(b.task_id) if self._usage else {}),
                        )
                    )
        refused = self._usage.answers.refusals() if self._usage is not None else {}
        return GatewayLoad(self.gateway_id, tuple(out), refused)


def _ms_per_token(seconds: float) -> float | None:
    """Issue 33: the capacity estimate for the load report (0: none)."""
    return round(seconds * 1000, 3) if seconds > 0 else None


def _allowed_methods(path: str) -> bytes | None:
    """The methods a /v1 path takes (None: no such path), for OPTIONS."""
    if path in _INFERENCE_PATHS:
        return b"POST"
    if path == "/v1/models" or path.startswith(MODELS_PREFIX):
        return b"GET"
    return None


async def _not_allowed(send: Send, method: str, path: str, allow: bytes) -> None:
    await errors.send_error(send, errors.method_not_allowed(method, path), [(b"allow", allow)])
