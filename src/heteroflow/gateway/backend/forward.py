"""Forwarding one admitted inference request to its backend, and settling it.

The last step of ``GatewayApp._proxy``: the request as the engine must see it (M7: a
stream's usage asked for; issue 15: what shapes the answer, ``normalize``; M6: the
engine's own model id), sent; failover to another backend of the route when the chosen
one provably did not answer (``retry``: its connection could not be made, or it closed
before any byte of an answer; never once any answer began), within the request's
deadline; the answer relayed (``relay``); and the request settled once, whatever
happened (``admission``). A backend that failed is kept out of selection for a cooldown
(M5, ``health``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import orjson

from heteroflow.core.clock import Clock
from heteroflow.gateway import assemble
from heteroflow.gateway.backend.relay import Watch, relay, watch_disconnect
from heteroflow.gateway.backend.retry import Failovers, without
from heteroflow.gateway.backend.upstream import Upstream, UpstreamFailure
from heteroflow.gateway.inbound import Call, Exchange
from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.policy.admission import Admission
from heteroflow.gateway.policy.usage import Usage, UsageTracker
from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.gateway.shaping import normalize
from heteroflow.gateway.shaping.responses import CHAT_PATH
from heteroflow.gateway.shaping.responses_adapter import ResponsesExit
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Receive, Scope
from heteroflow.gateway.wire.http_conventions import REQUEST_ID_KEY
from heteroflow.gateway.wire.http_wire import Response
from heteroflow.schemas.routing import Backend, RouteTarget

# The request path's lines keep the logger name they had before app.py was split
# (operators filter on it; docs/operations.md shows it).
logger = logging.getLogger("heteroflow.gateway.app")


class Forwarder:
    """Sends, fails over, relays and settles; one per gateway."""

    def __init__(
        self,
        upstream: Upstream,
        balancer: Balancer,
        health: PassiveHealth,
        admission: Admission,
        metrics: GatewayMetrics,
        clock: Clock,
        *,
        connect_retries: int,
        retry_unanswered: bool,
        upstream_timeout_s: float,
    ) -> None:
        self._upstream = upstream
        self._balancer = balancer
        self._health = health
        self._settle = admission.settle
        self._metrics = metrics
        self._clock = clock
        # How many other backends a request may be sent on to when the connection to its
        # backend failed before anything was sent (gateway.retry); 0 turns failover off.
        self._connect_retries = connect_retries
        # Whether a request whose engine closed the connection before any byte of an
        # answer is sent once to another backend (gateway.retry), within the request's
        # deadline: upstream_timeout_s from its first send.
        self._retry_unanswered = retry_unanswered
        self._upstream_timeout_s = upstream_timeout_s

    async def relay_and_settle(
        self, scope: Scope, receive: Receive, call: Call, send: Exchange, path: str
    ) -> None:
        """Send (failing over when the backend provably did not answer), relay the answer,
        and settle usage, limits and the idempotency record once, whatever happened."""
        body, model, targets, balancer = call.body, call.model, call.targets, self._balancer
        upstream = path if call.responses is None else CHAT_PATH  # M14: chat answers it
        backend = call.backend
        assert backend is not None and targets is not None
        delivered = False  # the relay delivered the whole answer
        # M7: a stream's usage asked for, and hidden from a client that did not ask
        dirty = hide_usage = (
            body.get("stream") is True and path != "/v1/embeddings" and _ask_for_usage(body)
        )
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
        watch = Watch()
        # In flight from the choice until the answer ends, fails or the client leaves
        # (the ``finally`` below), so that least_connections sees streams as busy.
        balancer.acquire(backend)
        watcher = asyncio.create_task(watch_disconnect(receive, task, watch))
        try:
            failovers: Failovers | None = None  # made at the first failure (gateway.retry)
            while True:
                # the request's deadline counts from its first send (the failovers are made
                # at the first failure); the answered send's time teaches capacity (M15)
                sent = time.monotonic()
                attempt = self._send(
                    backend, scope, upstream, body, model, call.raw, dirty, targets
                )
                resp = await (attempt if failovers is None else _by(failovers.deadline, attempt))
                if resp is None:  # a failover's answer did not come by the request's deadline
                    watch.finished = True  # (not that backend's fault: it is not ejected)
                    await errors.send_error(send, errors.upstream_timeout())
                    return
                if not isinstance(resp, UpstreamFailure):
                    break
                if failovers is None:
                    failovers = Failovers(
                        self._connect_retries,
                        self._retry_unanswered,
                        sent + self._upstream_timeout_s,
                    )
                other = self._fail_over(backend, resp, failovers, targets, call.pin)
                if other is None:
                    watch.finished = True
                    await errors.send_error(send, resp.error)
                    return
                backend = call.backend = other  # the one that answers (its tokens, issue 14)
            answered = resp.status < 300
            try:
                out = send if call.responses is None else ResponsesExit(send, call.responses, model)
                relayed = await relay(
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
            _observe(balancer, backend, sent, usage.usage, answered and delivered)
            await self._settle(call, send, model, usage.usage, answered, delivered)

    def _fail_over(
        self,
        failed: Backend,
        resp: UpstreamFailure,
        failovers: Failovers,
        targets: tuple[RouteTarget, ...],
        pin: tuple[str, str, str] | None,
    ) -> Backend | None:
        """``failed`` is ejected (unreachable, reset or timed out); another backend of the
        route takes its place in flight only when it provably did not answer
        (gateway.retry): admission, idempotency and usage still count the request once.
        None: the failure is the answer."""
        self._eject(failed.base_url)
        other: Backend | None = None
        if failovers.allow(
            failed.base_url,
            nothing_sent=resp.nothing_sent,
            unanswered=resp.unanswered,
            now=time.monotonic(),
        ):
            other = self._balancer.choose(
                without(targets, failovers.tried), pin, fail_open=False
            )
        if other is not None:
            self._metrics.failed_over(failed.base_url)
            self._balancer.release(failed)  # no await in between: always paired
            self._balancer.acquire(other)
        return other

    async def _send(
        self,
        backend: Backend,
        scope: Scope,
        path: str,
        body: dict[str, object],
        model: str,
        raw: bytes,
        dirty: bool,
        targets: tuple[RouteTarget, ...] = (),
    ) -> Response | UpstreamFailure:
        """One attempt: the request as ``backend`` must see it, sent; its response headers.

        ``raw`` is the body as the client sent it with ``model`` (``dirty``: ``body`` was
        changed since and must be serialized again).
        """
        # M6: engines serve their model under their own id (often a path or a file name);
        # callers use the route's name. Rename only when the backend would not know the
        # requested name, and re-serialize only then. Recomputed per backend, since a
        # failover may reach an engine that names the model differently. A LoRA adapter
        # is the engine's own name (loaded at runtime, maybe after the ids were cached):
        # never renamed — the base model would answer in its place.
        upstream_model = model
        if not _adapter_of(targets, backend):
            known = await self._upstream.model_ids(backend.base_url, backend.auth)
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
            self._metrics.upstream_latency(model, time.perf_counter() - sent_at)
        return resp

    def _eject(self, base_url: str) -> None:
        """M5: keep a failing backend out of selection for a cooldown (routing only)."""
        if self._health.eject(base_url):
            self._metrics.ejected(base_url)
            logger.warning(
                "backend %s: ejected from routing for %.1f s after a failure",
                base_url,
                self._health.cooldown_s,
            )


def _observe(
    balancer: Balancer, backend: Backend, sent: float, usage: Usage | None, whole: bool
) -> None:
    """M15 ``capacity``: a whole 2xx answer whose tokens are known teaches its backend's
    seconds per token (``sent``: when the answered attempt was sent, ``time.monotonic()``,
    the balancer's clock)."""
    if whole and usage is not None:
        balancer.observe(backend, time.monotonic() - sent, usage.completion_tokens)


def _adapter_of(targets: tuple[RouteTarget, ...], backend: Backend) -> bool:
    """Whether ``backend`` serves the requested name as a LoRA adapter of its group."""
    return any(t.adapter and t.group_id == backend.group_id for t in targets)


def _ask_for_usage(body: dict[str, Any]) -> bool:
    """M7: an engine reports a stream's tokens only when asked to; ask (True: the extra
    usage event is hidden from the client, which must see what OpenAI sends), unless the
    client asked itself."""
    opts = body.get("stream_options")
    if opts is None or (isinstance(opts, dict) and opts.get("include_usage") is not True):
        body["stream_options"] = {**(opts or {}), "include_usage": True}
        return True
    return False


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
