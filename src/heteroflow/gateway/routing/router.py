"""Routing one inference request: which model, and which backend of its route.

The step of ``GatewayApp._proxy`` between parsing and admission: ``model=auto`` (M10: a
choice among the key's models by capability, prompt length and load), the key's access
to the model, the capability check (issue 15), the session pin (M4) and the first
backend (``balancing``). A model whose service sleeps (F6) is woken, or whose replicas are
starting (M17) is waited for, and the request held until it can be answered (``hold``),
bounded by ``gateway_wake_hold_s`` / ``gateway_start_hold_s``; each request routed to a
group notes the group's last request time (F4, the server's idle timer).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from heteroflow.gateway.inbound import Call, Exchange, disconnected, header, session_id
from heteroflow.gateway.policy.usage import UsageCollector
from heteroflow.gateway.routing.auto import (
    AUTO_MODEL,
    CAPABILITIES_HEADER,
    AutoChoice,
    NoAutoChoice,
    choose_model,
    estimate_prompt_tokens,
    parse_capabilities,
)
from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.capability_check import refuse as refuse_capability
from heteroflow.gateway.routing.hold import ClientLeft, Ready, RoutableHold, hold_reason
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Receive, Scope
from heteroflow.schemas.routing import KeyEntry, RouteTarget, RoutingSnapshot


class Router:
    """Chooses the model and the first backend of a request (a failover's next backend
    is ``forward``'s)."""

    def __init__(
        self,
        balancer: Balancer,
        hold: RoutableHold,
        usage: UsageCollector | None,
        *,
        auto_long_prompt_tokens: int,
    ) -> None:
        self._balancer = balancer
        self._hold = hold
        self._usage = usage
        self._auto_long_prompt_tokens = auto_long_prompt_tokens

    async def route(
        self, scope: Scope, receive: Receive, call: Call, send: Exchange, path: str
    ) -> bool:
        """model=auto, the key's access to the model, its route, the session pin and the
        first backend (waking the model first when it sleeps, waiting for it when its
        replicas are starting); False when the request
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
        sid = session_id(scope)
        if sid is None:
            user = body.get("user")
            if isinstance(user, str) and user:
                sid = user
        call.pin = None if sid is None else (entry.tenant_id, model, sid)
        backend = self._balancer.choose(targets, call.pin, body=body)
        if backend is None and hold_reason(targets) is not None:
            # F6: the model sleeps (wake it), M17: its replicas are starting; hold the
            # request until it can be answered
            held = await self._hold.hold(
                entry.tenant_id, model, targets, lambda: disconnected(receive)
            )
            if isinstance(held, ClientLeft):
                return False
            if not isinstance(held, Ready):
                await errors.send_error(send, held.error, held.headers())
                return False
            call.snap = held.snapshot
            targets = call.targets = held.snapshot.routes.get((entry.tenant_id, model), ())
            backend = self._balancer.choose(targets, call.pin, body=body)
        if backend is None:
            await errors.send_error(send, errors.no_healthy_backend(model))
            return False
        call.backend = backend
        if self._usage is not None and backend.group_id:
            self._usage.touch(backend.group_id)  # F4: the group's last request
        return True

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
            capabilities=parse_capabilities(header(scope, CAPABILITIES_HEADER)),
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

    def _model_load(self, targets: Sequence[RouteTarget]) -> float:
        """Requests in flight through this gateway per usable backend of a model."""
        in_flight = self._balancer.in_flight
        counts = [in_flight(b) for t in targets for b in t.backends if not b.draining]
        return sum(counts) / len(counts) if counts else 0.0
