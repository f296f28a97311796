"""The OpenAI-compatible gateway: a raw ASGI3 app for the ``/v1`` paths.

Owns the request path of inference traffic: API-key check against the routing snapshot,
model access check, backend choice (``balancing``), model-name remap to the backend's own
model id, failover to another backend of the route when the chosen one provably did not
answer (``retry``: its connection could not be made, or it closed before any byte of an
answer; never once any answer began), and a byte relay of the backend's answer (SSE
chunk by chunk). No framework sits on this path, and nothing here logs per request at
INFO, because the gateway's CPU cost per request is its throughput limit (see
bench/gateway: a bare relay costs ~0.2 ms/request).

Paths: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /v1/models`` and ``GET /v1/models/{id}``. Anything else under ``/v1`` is an
OpenAI-shaped 404 (or 405 for a known path with the wrong method); ``OPTIONS``
(CORS preflights) and the headers every answer carries (``x-request-id``, CORS) are
``http_conventions``'. ``GET /metrics`` is
the gateway's Prometheus text (``metrics``); every other request is counted there, whatever
its path and outcome.

A model whose service sleeps (F6) is listed and called like any other: the request wakes
it and is held until it can be answered (``wake``), bounded by ``gateway_wake_hold_s``.
Each request routed to a group notes the group's last request time in the usage
collector (F4, the server's idle timer), and every usage flush carries this gateway's
load (``load_report``, issue 14): per backend, the requests in flight, the tokens/s it
answered, the engine's queue and KV use, and whether it drains — what the server's
autoscaler scales by and what the drains of a scale-in or a rolling update wait for.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Sequence
from typing import Any, NamedTuple

import orjson

from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from heteroflow.gateway import assemble, engine_errors, errors, normalize
from heteroflow.gateway.auto import (
    AUTO_MODEL,
    CAPABILITIES_HEADER,
    DEFAULT_LONG_PROMPT_TOKENS,
    AutoChoice,
    NoAutoChoice,
    choose_model,
    estimate_prompt_tokens,
    parse_capabilities,
)
from heteroflow.gateway.balancing import DEFAULT_MAX_TEMP_C, Balancer
from heteroflow.gateway.capability_check import refuse as refuse_capability
from heteroflow.gateway.engine_metrics import EngineLoad
from heteroflow.gateway.errors import Message, Receive, Scope, Send
from heteroflow.gateway.health import DEFAULT_COOLDOWN_S, PassiveHealth
from heteroflow.gateway.http_conventions import (
    REQUEST_ID_KEY,
    Conventions,
    decode_body,
    stream_headers,
)
from heteroflow.gateway.http_wire import Response, WireError
from heteroflow.gateway.idempotency import HEADER as IDEMPOTENCY_HEADER
from heteroflow.gateway.idempotency import Idempotency, Pending, Recorder
from heteroflow.gateway.limits import Limiter, Ticket
from heteroflow.gateway.metrics import GatewayMetrics, path_label
from heteroflow.gateway.probes import (
    DEFAULT_LOAD_SCRAPE_INTERVAL_S,
    DEFAULT_PROBE_INTERVAL_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_SCRAPE_INTERVAL_S,
    BackendMonitor,
)
from heteroflow.gateway.requests import check as check_request
from heteroflow.gateway.responses import CHAT_PATH, RESPONSES_PATH, to_chat
from heteroflow.gateway.responses_adapter import ResponsesExit
from heteroflow.gateway.retry import DEFAULT_CONNECT_RETRIES, Failovers, without
from heteroflow.gateway.store import GatewayStore, MemoryStore, open_store
from heteroflow.gateway.upstream import Upstream, UpstreamFailure
from heteroflow.gateway.usage import HttpUsageSink, Usage, UsageCollector, UsageTracker
from heteroflow.gateway.wake import (
    DEFAULT_HOLD_S,
    DEFAULT_POLL_S,
    DEFAULT_RETRY_AFTER_S,
    ClientLeft,
    HttpServerLink,
    Ready,
    ServerLink,
    WakeHold,
    asleep,
)
from heteroflow.logs import REQUEST_ID
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
)
from heteroflow.schemas.usage import BackendLoad, GatewayLoad
from heteroflow.settings import ServerSettings

logger = logging.getLogger(__name__)

_INFERENCE_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", RESPONSES_PATH}
)
_MODELS_PREFIX = "/v1/models/"
_METRICS_PATH = "/metrics"
MAX_BODY_BYTES = 64 * 1024 * 1024
# Backend response headers passed on to the client; hop-by-hop and framing headers are
# the server's business (uvicorn sets content-length or chunked itself).
_RELAYED_HEADERS = (b"content-type", b"content-encoding", b"cache-control")
_SSE_ERROR_CODE = "upstream_error"


class _BodyTooLarge(Exception):
    pass


class _Watch:
    """Shared between a proxied request and its disconnect watcher."""

    __slots__ = ("disconnected", "finished")

    def __init__(self) -> None:
        self.finished = False  # the final body message is being sent: nothing to cancel
        self.disconnected = False


class _Call:
    """One inference request as it goes through the steps of ``GatewayApp._proxy``."""

    __slots__ = (
        "backend", "body", "client_raw", "entry", "model", "pending", "pin", "raw", "responses",
        "snap", "targets", "ticket",
    )

    def __init__(
        self, snap: RoutingSnapshot, entry: KeyEntry, raw: bytes, body: dict[str, Any],
        model: str,
    ) -> None:
        self.snap = snap
        self.entry = entry
        self.client_raw = raw  # what an idempotency key's fingerprint covers (M9)
        self.raw = raw  # what is sent upstream (re-serialized when the body changes)
        self.body = body
        self.model = model
        self.targets: tuple[RouteTarget, ...] | None = None
        self.pin: tuple[str, str, str] | None = None
        self.backend: Backend | None = None
        self.pending: Pending | None = None
        self.ticket: Ticket | None = None
        self.responses: dict[str, Any] | None = None  # M14: the /v1/responses request


class _Exchange:
    """The ``send`` of one inference request: notes the status and model for metrics."""

    __slots__ = ("extra_headers", "model", "recorder", "send", "status")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.status = 0  # 0 until a response starts (the client left first)
        self.model = ""  # the routed model name, once the route is known
        # added to the response start: x-request-id and CORS (http_conventions), ...
        self.extra_headers = headers
        self.recorder: Recorder | None = None  # M9: keeps the answer for replays

    async def __call__(self, msg: Message) -> None:
        if self.recorder is not None:
            self.recorder.observe(msg)  # before extra_headers: those are not replayed
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            if self.extra_headers:
                msg = {**msg, "headers": [*msg.get("headers", ()), *self.extra_headers]}
        await self.send(msg)


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
        wake_retry_after_s: int = DEFAULT_RETRY_AFTER_S,
        wake_poll_s: float = DEFAULT_POLL_S,
        load_scrape_interval_s: float = DEFAULT_LOAD_SCRAPE_INTERVAL_S,
        cors_origins: Sequence[str] = (),
    ) -> None:
        self._holder = holder
        # issue 15: x-request-id, CORS (off without origins) on every /v1 answer
        self._conventions = Conventions(cors_origins)
        # issue 14: this gateway in the load reports (a new one at every start)
        self.gateway_id = f"gw-{secrets.token_hex(6)}"
        # How many other backends a request may be sent on to when the connection to its
        # backend failed before anything was sent (gateway.retry); 0 turns failover off.
        self._connect_retries = connect_retries
        # Whether a request whose engine closed the connection before any byte of an
        # answer is sent once to another backend (gateway.retry), within the request's
        # deadline: upstream_timeout_s from its first send.
        self._retry_unanswered = retry_unanswered
        self._upstream_timeout_s = upstream_timeout_s
        # M8 limits and M9 idempotency keys: in memory, or shared through Redis
        # (store.RedisStore); closed with the app.
        self._store: GatewayStore = store or MemoryStore()
        clock = clock or SystemClock()
        self._clock = clock
        # issue 15: /v1/models' ``created`` (the snapshot carries no creation times)
        self._created = int(clock.now().timestamp())
        self._limiter = Limiter(self._store, clock)
        self._idempotency = Idempotency(self._store, clock, lease_s=upstream_timeout_s + 60.0)
        self._usage = usage  # None: tokens are counted for metrics (and limits) only
        self.metrics = metrics or GatewayMetrics()
        # F6: requests for a sleeping model wake it (through ``link``: the server) and
        # wait for it here
        self.wake = WakeHold(
            holder,
            link,
            self.metrics,
            hold_s=wake_hold_s,
            retry_after_s=wake_retry_after_s,
            poll_s=wake_poll_s,
        )
        self._health = PassiveHealth(eject_cooldown_s)
        loads: dict[str, EngineLoad] = {}  # engine_aware: written by the monitor
        self._balancer = Balancer(
            self._health, max_sessions=max_sessions, max_temp_c=max_card_temp_c, loads=loads
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
        self._auto_long_prompt_tokens = auto_long_prompt_tokens
        self._upstream = Upstream(
            models_cache_ttl_s=models_cache_ttl_s,
            upstream_timeout_s=upstream_timeout_s,
            connect_timeout_s=connect_timeout_s,
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
            wake_retry_after_s=settings.gateway_wake_retry_after_s,
            wake_poll_s=settings.gateway_wake_poll_s,
            load_scrape_interval_s=settings.gateway_load_scrape_interval_s,
            cors_origins=settings.gateway_cors_origins,
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
        await self.wake.aclose()
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
            ex = _Exchange(send, self._conventions.begin(scope))
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

    async def _dispatch(self, scope: Scope, receive: Receive, ex: _Exchange, path: str) -> None:
        method: str = scope["method"]
        if path in _INFERENCE_PATHS:
            if method == "POST":
                await self._proxy(scope, receive, ex, path)
            else:
                await _not_allowed(ex, method, path, b"POST")
        elif path == "/v1/models" or path.startswith(_MODELS_PREFIX):
            if method == "GET":
                await self._list_models(scope, ex, path)
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
        body = self.metrics.render()
        headers = [(b"content-type", METRICS_CONTENT_TYPE), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _list_models(self, scope: Scope, send: Send, path: str) -> None:
        snap = self._holder.current
        entry = _authenticate(scope, snap)
        if isinstance(entry, errors.OpenAIError):
            await errors.send_error(send, entry)
            return
        # Only what the key may call *and* what has a route: a listed model must not
        # answer model_not_found when called.
        callable_ = sorted(m for m in entry.models if (entry.tenant_id, m) in snap.routes)
        if len(callable_) > 1 and AUTO_MODEL not in callable_:
            callable_.append(AUTO_MODEL)  # M10: a choice among them, listed last
        if path == "/v1/models":
            data = [_model_object(m, self._created) for m in callable_]
            body = orjson.dumps({"object": "list", "data": data})
        else:
            model = path[len(_MODELS_PREFIX) :]
            if model not in callable_:
                await errors.send_error(send, errors.model_not_found(model))
                return
            body = orjson.dumps(_model_object(model, self._created))
        await errors.send_json(send, 200, body)

    async def _proxy(self, scope: Scope, receive: Receive, send: _Exchange, path: str) -> None:
        """auth → route → admit → relay → settle: each step answers the client itself
        when the request ends there (and says so by returning None / False)."""
        if not self._started:
            self.start()  # embedders that never called start(): the first request does
        call = await self._authenticate_and_parse(scope, receive, send, path)
        if call is not None and path == RESPONSES_PATH and not await _as_chat(call, send):
            return
        if call is None or not await self._route(scope, receive, call, send, path):
            return
        if not await self._admit(scope, call, send, path):
            return
        await self._relay_and_settle(scope, receive, call, send, path)

    async def _authenticate_and_parse(
        self, scope: Scope, receive: Receive, send: _Exchange, path: str
    ) -> _Call | None:
        """The key (against the snapshot) and a JSON object body with a model name, in
        OpenAI's request shape for ``path`` (``requests``)."""
        snap = self._holder.current
        entry = _authenticate(scope, snap)
        if isinstance(entry, errors.OpenAIError):
            await errors.send_error(send, entry)
            return None
        try:
            raw = await _read_body(receive)
        except _BodyTooLarge:
            await errors.send_error(send, errors.payload_too_large(MAX_BODY_BYTES))
            return None
        if raw is None:  # the client left before sending its body
            return None
        encoding = _header(scope, b"content-encoding")
        if encoding is not None:  # gzip/deflate, limited to MAX_BODY_BYTES decoded
            decoded = decode_body(raw, encoding, MAX_BODY_BYTES)
            if isinstance(decoded, errors.OpenAIError):
                await errors.send_error(send, decoded)
                return None
            raw = decoded
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await errors.send_error(
                send,
                errors.invalid_request(
                    "We could not parse the JSON body of your request. The body must be valid JSON."
                ),
            )
            return None
        if not isinstance(body, dict):
            await errors.send_error(
                send, errors.invalid_request("The request body must be a JSON object.")
            )
            return None
        model = body.get("model")
        if not isinstance(model, str):
            await errors.send_error(
                send, errors.invalid_request("You must provide a model parameter.", "model")
            )
            return None
        bad = check_request(path, body)
        if bad is not None:
            await errors.send_error(send, bad)
            return None
        return _Call(snap, entry, raw, body, model)

    async def _route(
        self, scope: Scope, receive: Receive, call: _Call, send: _Exchange, path: str
    ) -> bool:
        """model=auto, the key's access to the model, its route, the session pin and the
        first backend (waking the model first when it sleeps); False when the request
        was answered here."""
        snap, entry, body = call.snap, call.entry, call.body
        model = call.model
        if model == AUTO_MODEL and (entry.tenant_id, model) not in snap.routes:
            # M10: choose among the key's models; the upstream gets the chosen name.
            auto = self._choose_auto(scope, snap, entry, body, path)
            if isinstance(auto, errors.OpenAIError):
                await errors.send_error(send, auto)
                return False
            model = body["model"] = auto.model
            call.raw = orjson.dumps(body)
            send.extra_headers.append(auto.header())
        targets = snap.routes.get((entry.tenant_id, model)) if model in entry.models else None
        if targets is None:
            await errors.send_error(send, errors.model_not_found(model))
            return False
        send.model = call.model = model
        call.targets = targets
        refused = refuse_capability(path, body, model, targets)  # issue 15: a clear 400
        if refused is not None:
            await errors.send_error(send, refused)
            return False
        # M4: X-Session-Id, else the body's ``user``, pins the session to a backend of
        # this route (scoped by tenant and model, so equal ids elsewhere do not collide).
        sid = _session_id(scope)
        if sid is None:
            user = body.get("user")
            if isinstance(user, str) and user:
                sid = user
        call.pin = None if sid is None else (entry.tenant_id, model, sid)
        backend = self._balancer.choose(targets, call.pin)
        if backend is None and asleep(targets):
            # F6: the model sleeps; wake it and hold the request until it can be answered
            held = await self.wake.hold(
                entry.tenant_id, model, targets, lambda: _disconnected(receive)
            )
            if isinstance(held, ClientLeft):
                return False
            if not isinstance(held, Ready):
                await errors.send_error(send, held.error, held.headers())
                return False
            call.snap = held.snapshot
            targets = call.targets = held.snapshot.routes.get((entry.tenant_id, model), ())
            backend = self._balancer.choose(targets, call.pin)
        if backend is None:
            await errors.send_error(send, errors.no_healthy_backend(model))
            return False
        call.backend = backend
        if self._usage is not None and backend.group_id:
            self._usage.touch(backend.group_id)  # F4: the group's last request
        return True

    async def _admit(self, scope: Scope, call: _Call, send: _Exchange, path: str) -> bool:
        """M9 idempotency first (a replay, 409 or 422 costs no rate limit), then M8."""
        entry = call.entry
        idem_key = _header(scope, IDEMPOTENCY_HEADER)
        if idem_key is not None:
            pending = await self._idempotency.begin(
                send, entry.endpoint_id, idem_key, path, call.client_raw
            )
            if pending is None:
                return False  # answered: the replay, or why the key cannot be used now
            call.pending = pending
            send.recorder = pending.recorder
        if entry.rpm_limit or entry.tpm_limit or entry.quota_tokens or entry.tenant_quota_tokens:
            admitted = await self._limiter.admit(entry, path, call.body, len(call.client_raw))
            if not isinstance(admitted, Ticket):
                await errors.send_error(send, *admitted)
                if call.pending is not None:
                    await self._idempotency.end(call.pending, False)
                return False
            call.ticket = admitted
            send.extra_headers += admitted.headers
        return True

    async def _relay_and_settle(
        self, scope: Scope, receive: Receive, call: _Call, send: _Exchange, path: str
    ) -> None:
        """Send (failing over when the backend provably did not answer), relay the answer,
        and settle usage, limits and the idempotency record once, whatever happened."""
        body, model, targets, balancer = call.body, call.model, call.targets, self._balancer
        upstream = path if call.responses is None else CHAT_PATH  # M14: chat answers it
        backend = call.backend
        assert backend is not None and targets is not None
        delivered = False  # the relay delivered the whole answer
        # M7: an engine reports a stream's tokens only when asked to; ask, and hide the
        # extra usage event from a client that did not ask (it must see what OpenAI sends).
        dirty = hide_usage = False
        if body.get("stream") is True and path != "/v1/embeddings":
            opts = body.get("stream_options")
            if opts is None or (isinstance(opts, dict) and opts.get("include_usage") is not True):
                body["stream_options"] = {**(opts or {}), "include_usage": True}
                dirty = hide_usage = True
        # issue 15: what shapes the answer (normalize); echo is done here for every engine
        asked = normalize.asked(upstream, body, int(self._clock.now().timestamp()))
        if isinstance(asked, errors.OpenAIError):  # cannot be answered as asked
            await errors.send_error(send, asked)
            await self._settle(call, send, model, None, False, False)
            return
        if asked.echo is not None:
            del body["echo"]
            dirty = True
        usage = UsageTracker(hide=hide_usage, asked=asked)
        answered = False  # a 2xx answer began: the request counts for usage

        task = asyncio.current_task()
        assert task is not None
        watch = _Watch()
        # In flight from the choice until the answer ends, fails or the client leaves
        # (the ``finally`` below), so that least_connections sees streams as busy.
        balancer.acquire(backend)
        watcher = asyncio.create_task(_watch_disconnect(receive, task, watch))
        try:
            started = time.monotonic()  # the request's deadline counts from its first send
            failovers: Failovers | None = None  # made at the first failure (gateway.retry)
            while True:
                attempt = self._send(backend, scope, upstream, body, model, call.raw, dirty)
                resp = await (attempt if failovers is None else _by(failovers.deadline, attempt))
                if resp is None:  # a failover's answer did not come by the request's deadline
                    watch.finished = True  # (not that backend's fault: it is not ejected)
                    await errors.send_error(send, errors.upstream_timeout())
                    return
                if not isinstance(resp, UpstreamFailure):
                    break
                self._eject(backend.base_url)  # unreachable, reset or timed out
                if failovers is None:
                    failovers = Failovers(
                        self._connect_retries,
                        self._retry_unanswered,
                        started + self._upstream_timeout_s,
                    )
                # Another backend of the route only when this one provably did not answer
                # (gateway.retry): admission, idempotency and usage still count it once.
                other: Backend | None = None
                if failovers.allow(
                    backend.base_url,
                    nothing_sent=resp.nothing_sent,
                    unanswered=resp.unanswered,
                    now=time.monotonic(),
                ):
                    other = balancer.choose(
                        without(targets, failovers.tried), call.pin, fail_open=False
                    )
                if other is None:
                    watch.finished = True
                    await errors.send_error(send, resp.error)
                    return
                self.metrics.failed_over(backend.base_url)
                balancer.release(backend)  # no await in between: always paired
                backend = call.backend = other  # the one that answers (its tokens, issue 14)
                balancer.acquire(backend)
            answered = resp.status < 300
            try:
                out = send if call.responses is None else ResponsesExit(send, call.responses, model)
                relayed = await _relay(
                    resp, out, watch, backend.base_url, usage, upstream, asked.stream
                )
            except BaseException:
                resp.close()  # an unfinished answer: drop the connection, never pool it
                raise
            if relayed.fault:
                # M5: only the backend's own fault (an answer that could not be read, a
                # 5xx that is no client mistake once normalised): the next request goes
                # elsewhere. A client's mistake never takes a replica out.
                self._eject(backend.base_url)
            delivered = relayed.delivered
            # (a llama.cpp stream's connection is never pooled: ``upstream``)
            resp.release()
        except asyncio.CancelledError:
            if watch.disconnected:
                # Our own cancellation (the client left): the upstream request is closed,
                # which tells the engine to stop generating. Nothing left to answer.
                task.uncancel()
                return
            raise
        finally:
            balancer.release(backend)
            watcher.cancel()
            await self._settle(call, send, model, usage.usage, answered, delivered)

    async def _settle(
        self,
        call: _Call,
        send: _Exchange,
        model: str,
        usage: Usage | None,
        answered: bool,
        delivered: bool,
    ) -> None:
        """Once per request: usage (also when a stream broke or the client left: tokens
        unknown), the M8 reservation corrected by the real usage, the M9 record."""
        if answered:
            self._account(call.entry, model, usage)
            if usage is not None and self._usage is not None and call.backend is not None:
                # issue 14: the backend's tokens/s (the autoscaler's tokens_per_s)
                self._usage.backend_tokens(
                    call.backend.task_id, usage.prompt_tokens + usage.completion_tokens
                )
        if call.ticket is not None:
            used = None if usage is None else usage.prompt_tokens + usage.completion_tokens
            self._limiter.settle(call.ticket, send.status or None, used)
        if call.pending is not None:
            await self._idempotency.end(call.pending, delivered)

    async def _send(
        self,
        backend: Backend,
        scope: Scope,
        path: str,
        body: dict[str, object],
        model: str,
        raw: bytes,
        dirty: bool,
    ) -> Response | UpstreamFailure:
        """One attempt: the request as ``backend`` must see it, sent; its response headers.

        ``raw`` is the body as the client sent it with ``model`` (``dirty``: ``body`` was
        changed since and must be serialized again).
        """
        # M6: engines serve their model under their own id (often a path or a file name);
        # callers use the route's name. Rename only when the backend would not know the
        # requested name, and re-serialize only then. Recomputed per backend, since a
        # failover may reach an engine that names the model differently.
        known = await self._upstream.model_ids(backend.base_url, backend.auth)
        upstream_model = model
        if known is not None and known.first is not None and model not in known.ids:
            upstream_model = known.first
        if (
            path in assemble.PATHS
            and body.get("stream") is not True
            and self._upstream.assembles(backend.base_url)
        ):
            # issue 15: llama.cpp stops only a stream whose client left; the relay
            # assembles the client's JSON answer (a copy: a failover may go elsewhere)
            body, dirty = assemble.as_stream(body), True
        if dirty or upstream_model != model:
            body["model"] = upstream_model
            raw = orjson.dumps(body)
        url = backend.base_url + path
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        sent_at = time.perf_counter()
        resp = await self._upstream.open(
            url, raw, backend, scope.get(REQUEST_ID_KEY, ""), body.get("stream") is True
        )
        if not isinstance(resp, UpstreamFailure):
            self.metrics.upstream_latency(model, time.perf_counter() - sent_at)
        return resp

    def _choose_auto(
        self,
        scope: Scope,
        snap: RoutingSnapshot,
        entry: KeyEntry,
        body: dict[str, object],
        path: str,
    ) -> AutoChoice | errors.OpenAIError:
        tenant = entry.tenant_id
        routes = {m: ts for m in entry.models if (ts := snap.routes.get((tenant, m))) is not None}
        choice = choose_model(
            routes,
            embeddings=path == "/v1/embeddings",
            capabilities=parse_capabilities(_header(scope, CAPABILITIES_HEADER)),
            prompt_tokens=estimate_prompt_tokens(body),
            long_prompt_tokens=self._auto_long_prompt_tokens,
            load=self._model_load,
        )
        if isinstance(choice, NoAutoChoice):
            return errors.OpenAIError(
                404,
                f"model=auto: {choice.message}.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return choice

    def load_report(self) -> GatewayLoad:
        """Issue 14: every backend of the current snapshot as this gateway sees it —
        requests in flight through it, whether the snapshot says it drains, the tokens/s
        it answered (the usage collector's window), the engine's queue and KV use (the
        latest scrape). Backends without a group (a routes file's) are left out."""
        snap = self._holder.current
        rates = self._usage.token_rates if self._usage is not None else {}
        seen: set[str] = set()
        out: list[BackendLoad] = []
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
                            in_flight=self._balancer.in_flight(b),
                            tokens_per_s=rates.get(b.task_id, 0.0),
                            waiting=None if engine is None else engine.waiting,
                            kv_use=None if engine is None else engine.kv_use,
                        )
                    )
        return GatewayLoad(self.gateway_id, tuple(out))

    def _model_load(self, targets: Sequence[RouteTarget]) -> float:
        """Requests in flight through this gateway per usable backend of a model."""
        in_flight = self._balancer.in_flight
        counts = [in_flight(b) for t in targets for b in t.backends if not b.draining]
        return sum(counts) / len(counts) if counts else 0.0

    def _account(self, entry: KeyEntry, model: str, usage: Usage | None) -> None:
        if self._usage is not None:
            self._usage.record(entry.endpoint_id, entry.tenant_id, model, usage)
        if usage is not None:
            self.metrics.tokens_used(model, usage.prompt_tokens, usage.completion_tokens)

    def _eject(self, base_url: str) -> None:
        """M5: keep a failing backend out of selection for a cooldown (routing only)."""
        if self._health.eject(base_url):
            self.metrics.ejected(base_url)
            logger.warning(
                "backend %s: ejected from routing for %.1f s after a failure",
                base_url,
                self._health.cooldown_s,
            )


class _Relayed(NamedTuple):
    """How relaying an answer went."""

    delivered: bool  # the whole answer reached the client
    fault: bool  # the backend failed (M5: it is ejected)


async def _relay(
    resp: Response,
    send: Send,
    watch: _Watch,
    base_url: str,
    usage: UsageTracker,
    path: str,
    streamed: bool,
) -> _Relayed:
    """Relay the backend's answer in OpenAI's shape (``normalize``, issue 15).

    An error answer (>= 400) is read whole and answered as OpenAI's error object; a
    JSON answer is fixed where the engine deviates (``usage.answer``, which also picks
    up the token usage, ``usage.usage``); a stream's events go through ``usage.feed``,
    unless the client did not ask for one (``streamed``): then it is assembled into the
    JSON answer (``_relay_assembled``). Bytes in a content-encoding are relayed as they
    came.
    """
    ctype = resp.headers.get("Content-Type") or ""
    if not streamed and resp.status < 300 and ctype.startswith("text/event-stream"):
        return await _relay_assembled(resp, send, watch, base_url, usage, path)
    # ASGI wants lower-case header names; raw_headers keep the backend's spelling.
    headers = [(n.lower(), v) for n, v in resp.raw_headers if n.lower() in _RELAYED_HEADERS]
    if resp.status >= 400 or not ctype.startswith("text/event-stream"):
        try:
            data = await resp.read()
        except TimeoutError:
            watch.finished = True
            await errors.send_error(send, errors.upstream_timeout())
            return _Relayed(False, True)
        except WireError as exc:
            logger.warning(
                "backend %s: reading the answer failed: %s", base_url, type(exc).__name__
            )
            watch.finished = True
            await errors.send_error(send, errors.upstream_error())
            return _Relayed(False, True)
        watch.finished = True
        readable = (resp.headers.get("Content-Encoding") or "identity") == "identity"
        if resp.status >= 400 and readable:
            err = engine_errors.engine_error(resp.status, data, ctype, path)
            await errors.send_error(send, err)
            return _Relayed(True, engine_errors.is_backend_fault(err))
        if resp.status < 300:
            fixed = usage.answer(data) if readable else data
            if isinstance(fixed, errors.OpenAIError):  # e.g. dimensions it cannot give
                await errors.send_error(send, fixed)
                return _Relayed(True, False)
            data = fixed
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        return _Relayed(True, resp.status >= 500)
    headers = stream_headers(headers)  # issue 15: cache-control: no-cache, no proxy buffering
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    try:
        async for chunk in resp.iter_any():
            out = usage.feed(chunk)  # whole events only; the hidden usage event dropped
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        tail = usage.finish()
    except WireError as exc:
        # Headers are gone already; an SSE error event is how OpenAI clients learn that
        # the stream broke (the SDK raises APIError on it) instead of a silent truncation.
        logger.warning("backend %s: stream broke: %s", base_url, type(exc).__name__)
        err = errors.OpenAIError(
            502,
            "The model backend's stream ended unexpectedly.",
            "server_error",
            None,
            _SSE_ERROR_CODE,
        )
        # A partial event held back is dropped: the client gets a clean error event.
        tail = b"data: " + err.body() + b"\n\n"
        watch.finished = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return _Relayed(False, True)
    watch.finished = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    return _Relayed(True, False)


async def _relay_assembled(
    resp: Response,
    send: Send,
    watch: _Watch,
    base_url: str,
    usage: UsageTracker,
    path: str,
) -> _Relayed:
    """Issue 15: the stream asked for a client that wants one JSON answer (llama.cpp
    stops only a stream's generation when the client leaves: ``assemble``), answered as
    that JSON answer (``usage.assembled``), or as the error its error event says."""
    asm = assemble.Assembler(path)
    answer: dict[str, Any] | errors.OpenAIError
    try:
        async for chunk in resp.iter_any():
            asm.feed_sse(chunk)
        answer = asm.result()
    except TimeoutError:
        answer = errors.upstream_timeout()
    except WireError as exc:
        logger.warning("backend %s: stream broke: %s", base_url, type(exc).__name__)
        answer = errors.upstream_error()
    watch.finished = True
    if isinstance(answer, errors.OpenAIError):
        await errors.send_error(send, answer)
        # an error event is the engine's answer; a broken stream is its fault (M5)
        complete = asm.complete
        return _Relayed(complete, engine_errors.is_backend_fault(answer) or not complete)
    data = usage.assembled(answer)
    if isinstance(data, errors.OpenAIError):  # what normalize refuses (as ``answer``)
        await errors.send_error(send, data)
        return _Relayed(True, False)
    await errors.send_json(send, 200, data)
    return _Relayed(True, False)


async def _by(
    deadline: float, attempt: Awaitable[Response | UpstreamFailure]
) -> Response | UpstreamFailure | None:
    """A failover's attempt, its answer's headers due by ``deadline`` (``time.monotonic()``,
    the request's: ``gateway.retry``); None when they did not come by then (the connection
    is closed, which tells the engine to stop)."""
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            return await attempt
    except TimeoutError:
        return None


async def _as_chat(call: _Call, send: Send) -> bool:
    """M14: a ``/v1/responses`` request becomes the chat completions request that answers
    it (``responses.to_chat``), checked as one; False when it was refused here. The
    idempotency fingerprint keeps the client's own body."""
    chat = to_chat(call.body)
    if isinstance(chat, errors.OpenAIError):
        await errors.send_error(send, chat)
        return False
    bad = check_request(CHAT_PATH, chat)
    if bad is not None:
        await errors.send_error(send, bad)
        return False
    call.responses, call.body, call.raw = call.body, chat, orjson.dumps(chat)
    return True


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _watch_disconnect(receive: Receive, task: asyncio.Task[object], watch: _Watch) -> None:
    # After the body is read, the only message left is http.disconnect (uvicorn also
    # sends it once the response is complete, hence the ``finished`` flag).
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not watch.finished:
                watch.disconnected = True
                task.cancel()
            return


def _authenticate(scope: Scope, snap: RoutingSnapshot) -> KeyEntry | errors.OpenAIError:
    for name, value in scope["headers"]:
        if name == b"authorization":
            if value[:7].lower() != b"bearer ":
                break
            key = value[7:].strip()
            if not key:
                break
            # Same digest as snapshot.hash_key() for the ASCII keys we issue, without a
            # str round trip.
            entry = snap.keys.get(hashlib.sha256(key).hexdigest())
            return entry if entry is not None else errors.invalid_api_key(missing=False)
    return errors.invalid_api_key(missing=True)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for n, value in scope["headers"]:
        if n == name:
            return bytes(value)
    return None


def _session_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-session-id":
            return value.decode("latin-1") or None
    return None


async def _read_body(receive: Receive) -> bytes | None:
    msg = await receive()
    if msg["type"] != "http.request":
        return None
    body: bytes = msg.get("body", b"")
    size = len(body)
    if size > MAX_BODY_BYTES:
        raise _BodyTooLarge
    if not msg.get("more_body", False):
        return body
    parts = [body]
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk: bytes = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BodyTooLarge
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


def _model_object(model: str, created: int) -> dict[str, object]:
    return {"id": model, "object": "model", "created": created, "owned_by": "heteroflow"}


def _allowed_methods(path: str) -> bytes | None:
    """The methods a /v1 path takes (None: no such path), for OPTIONS."""
    if path in _INFERENCE_PATHS:
        return b"POST"
    if path == "/v1/models" or path.startswith(_MODELS_PREFIX):
        return b"GET"
    return None


async def _not_allowed(send: Send, method: str, path: str, allow: bytes) -> None:
    await errors.send_error(send, errors.method_not_allowed(method, path), [(b"allow", allow)])
