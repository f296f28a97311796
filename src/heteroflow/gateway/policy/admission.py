"""Admission and settlement of one inference request: what it may cost, and what it did.

``admit`` runs after routing and before the first send: an idempotency key (M9) first,
so that a replay, a 409 or a 422 costs no rate limit, then the key's and the tenant's
limits (M8), which reserve the request's tokens. ``settle`` runs exactly once per
admitted request whatever happened to it (``forward``): the usage is counted (also when
a stream broke or the client left: tokens unknown), the M8 reservation corrected by the
real usage, and the M9 record completed or released.
"""

from __future__ import annotations

from heteroflow.core.clock import Clock
from heteroflow.gateway.inbound import Call, Exchange, header
from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.policy.idempotency import HEADER as IDEMPOTENCY_HEADER
from heteroflow.gateway.policy.idempotency import Idempotency
from heteroflow.gateway.policy.limits import Limiter, Ticket
from heteroflow.gateway.policy.usage import Usage, UsageCollector
from heteroflow.gateway.routing.store import GatewayStore
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Scope
from heteroflow.schemas.routing import KeyEntry


class Admission:
    """M8 limits and M9 idempotency keys over one store (in memory, or Redis), and the
    usage collector (None: tokens are counted for metrics and limits only)."""

    def __init__(
        self,
        store: GatewayStore,
        clock: Clock,
        *,
        idempotency_lease_s: float,
        usage: UsageCollector | None,
        metrics: GatewayMetrics,
    ) -> None:
        self._limiter = Limiter(store, clock)
        self._idempotency = Idempotency(store, clock, lease_s=idempotency_lease_s)
        self._usage = usage
        self._metrics = metrics

    async def admit(self, scope: Scope, call: Call, send: Exchange, path: str) -> bool:
        """M9 idempotency first (a replay, 409 or 422 costs no rate limit), then M8."""
        entry = call.entry
        idem_key = header(scope, IDEMPOTENCY_HEADER)
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

    async def settle(
        self,
        call: Call,
        send: Exchange,
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

    def _account(self, entry: KeyEntry, model: str, usage: Usage | None) -> None:
        if self._usage is not None:
            self._usage.record(entry.endpoint_id, entry.tenant_id, model, usage)
        if usage is not None:
            self._metrics.tokens_used(model, usage.prompt_tokens, usage.completion_tokens)
