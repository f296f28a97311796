"""The management API application (FastAPI) and the all-in-one ASGI dispatcher."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from fastapi import FastAPI

from heteroflow.api import errors
from heteroflow.api.audit_middleware import AuditMiddleware
from heteroflow.api.context import ServerContext
from heteroflow.api.observe import ObserveMiddleware  # issue 18 (P3)
from heteroflow.api.routes import (
    adapters,  # issue 28: LoRA adapters
    audit,
    auth,
    console,  # issue 17: the web console's assets
    drain,
    engines,  # issue 28 (H8)
    files,
    gateway,
    hub_tokens,  # issue 29 (H9): per-tenant hub tokens
    logs,
    model_requests,  # issue 29: the nodes' model caches
    nodes,
    platform_settings,  # issue 16 (L1)
    registry_credentials,  # issue 28 (H7)
    root,
    series,
    servers,
    sharing_groups,
    task_groups,
    task_life,
    tenants,
    usage,
)
from heteroflow.api.security_headers import SecurityHeadersMiddleware
from heteroflow.core.prometheus import CONTENT_TYPE
from heteroflow.services.metrics import ServerMetrics


def create_api(ctx: ServerContext, metrics: ServerMetrics | None = None) -> FastAPI:
    app = FastAPI(
        title="HeteroFlow",
        version=root.package_version() or "0.0.0",
        description="Management API: task groups, tasks, endpoints, routes, nodes, tenants.",
        openapi_url="/api/v1/openapi.json",
        # the API reference is root.api_docs: Swagger UI from the package, not a CDN's;
        # no ReDoc and no OAuth2 redirect page (the API takes bearer tokens only)
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.state.ctx = ctx
    errors.install(app)
    # Every management write -> one audit_log row, after the answer is sent (not the
    # agents' and gateways' own high-frequency calls; see the module).
    app.add_middleware(AuditMiddleware, ctx=ctx)
    # CSP, no framing, nosniff on every answer, pages or not (one place: the module)
    app.add_middleware(SecurityHeadersMiddleware)
    # issue 18 (P3), outermost: the request id (echoed, in every log line) and latency
    app.add_middleware(ObserveMiddleware, metrics=metrics)
    # The agents' router first: FastAPI matches a request against every route of every
    # router included before the one that answers (twice: to match, then to handle), and
    # the agents' heartbeat is the request a fleet sends most (bench/control_plane.py:
    # matching was 43 % of a heartbeat's server time with it tenth). No path of the
    # others is one of its paths, so the order changes no answer.
    for r in (
        nodes.router,
        auth.router,
        tenants.router,
        sharing_groups.router,
        platform_settings.router,  # issue 16 (L1)
        registry_credentials.router,  # issue 28 (H7)
        hub_tokens.router,  # issue 29 (H9)
        task_groups.router,
        adapters.router,  # issue 28: LoRA adapters
        drain.router,
        task_life.router,  # sleep / wake (F1-F3)
        gateway.router,
        series.router,
        usage.router,
        logs.router,
        files.router,
        model_requests.router,  # issue 29 (H9)
        audit.router,
        servers.router,
        engines.router,
        root.router,  # GET /: what this is, for a browser (HTML) or a client (JSON)
        console.router,  # /console/{path}: the web console's files (issue 17)
    ):
        app.include_router(r)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


ASGIApp = Any


class Dispatcher:
    """/v1 (and the gateway's /metrics) go straight to the gateway (no framework on the hot
    path); the rest to the API. With ``metrics`` (issue 18), ``GET /metrics`` answers what
    it renders: the gateway's series and the server's."""

    def __init__(
        self,
        gateway: ASGIApp,
        api: ASGIApp,
        metrics: Callable[[], Awaitable[bytes]] | None = None,
        fast: Mapping[tuple[str, str], ASGIApp] | None = None,
    ) -> None:
        self.gateway = gateway
        self.api = api
        self.metrics = metrics
        # (method, exact path) -> an app that answers it before the API's framework
        # (the agents' heartbeat: api/heartbeat_fast.py)
        self.fast = dict(fast or {})

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)  # lifespan, websockets
            return
        path = scope["path"]
        if path.startswith("/v1") or path == "/metrics":
            metrics = self.metrics
            if metrics is not None and path == "/metrics" and scope["method"] == "GET":
                await self._send_metrics(send, await metrics())  # the gateway's + the server's
            else:
                await self.gateway(scope, receive, send)
        elif self.fast and (app := self.fast.get((scope["method"], path))):
            await app(scope, receive, send)
        else:
            await self.api(scope, receive, send)

    @staticmethod
    async def _send_metrics(send: Any, body: bytes) -> None:
        headers = [(b"content-type", CONTENT_TYPE), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
