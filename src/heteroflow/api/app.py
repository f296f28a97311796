"""The management API application (FastAPI) and the all-in-one ASGI dispatcher."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI

from heteroflow.api import errors
from heteroflow.api.audit_middleware import AuditMiddleware
from heteroflow.api.context import ServerContext
from heteroflow.api.routes import (
    audit,
    auth,
    drain,
    files,
    gateway,
    logs,
    nodes,
    root,
    servers,
    sharing_groups,
    task_groups,
    task_life,
    tenants,
    usage,
)


def create_api(ctx: ServerContext) -> FastAPI:
    app = FastAPI(
        title="HeteroFlow",
        version=root.package_version() or "0.0.0",
        description="Management API: task groups, tasks, endpoints, routes, nodes, tenants.",
        openapi_url="/api/v1/openapi.json",
        docs_url="/api/v1/docs",
        redoc_url=None,
    )
    app.state.ctx = ctx
    errors.install(app)
    # Every management write -> one audit_log row, after the answer is sent (not the
    # agents' and gateways' own high-frequency calls; see the module).
    app.add_middleware(AuditMiddleware, ctx=ctx)
    for r in (
        auth.router,
        tenants.router,
        sharing_groups.router,
        task_groups.router,
        drain.router,
        task_life.router,  # sleep / wake (F1-F3)
        gateway.router,
        usage.router,
        nodes.router,
        logs.router,
        files.router,
        audit.router,
        servers.router,
        root.router,  # GET /: what this is, for a browser (HTML) or a client (JSON)
    ):
        app.include_router(r)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


ASGIApp = Any


class Dispatcher:
    """/v1 (and the gateway's /metrics) go straight to the gateway (no framework on the hot
    path); the rest to the API."""

    def __init__(self, gateway: ASGIApp, api: ASGIApp) -> None:
        self.gateway = gateway
        self.api = api

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (
            scope["path"].startswith("/v1") or scope["path"] == "/metrics"
        ):
            await self.gateway(scope, receive, send)
        else:
            await self.api(scope, receive, send)
