"""Audit log of management writes: a pure ASGI wrapper (no response buffering).

Every POST/PUT/PATCH/DELETE under ``/api/v1/`` gets one ``audit_log`` row once its
answer's status is known: when, who (the principal ``get_principal`` put in
``request.state``, i.e. ``scope["state"]``; or the machine that ``get_node_id`` /
``require_gateway`` authenticated), method, path, status, the TCP peer, and the ids
from the path. Never the body: bodies carry passwords and API keys. Failed writes
(4xx, 5xx) and login attempts (200/401/429, no user: the name is in the body) are
recorded too.

Not recorded: machine traffic that authenticated as the machine — the agent's calls
under ``/api/v1/agent/`` (heartbeats, claims, reports, log appends, file chunks) and a
gateway's ``POST /api/v1/gateway/usage``. They come every few seconds from every node
and gateway and would drown the log; their effects are in ``events``. The same paths
called *without* a valid node or gateway token are recorded (someone probing the
tokens).

When: after the last byte of the answer went to the server, in a worker thread, within
this ASGI call. The client is never kept waiting for the audit write, and the ASGI call
ends only once the row is committed — so an in-process client (the tests' TestClient,
httpx's ASGITransport), which returns when the call ends, reads the row right after
the answer. A failed audit write is logged (the exception's type, never values) and
never changes the answer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heteroflow.api.context import ServerContext
from heteroflow.services.identity import audit

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1/"
# path test, and the machine that must have authenticated for the call to be skipped
_MACHINE_CALLS: tuple[tuple[str, bool, str], ...] = (
    ("/api/v1/agent/", True, "agent"),  # a prefix
    ("/api/v1/gateway/usage", False, "gateway"),  # an exact path
    ("/api/v1/gateway/activity", False, "gateway"),  # last-request times (F4), per flush
)


def is_machine_call(path: str, actor: str) -> bool:
    for p, prefix, who in _MACHINE_CALLS:
        if actor == who and (path.startswith(p) if prefix else path == p):
            return True
    return False


class AuditMiddleware:
    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        self._prune_lock = threading.Lock()
        self._next_prune: float | None = None  # ctx.clock.monotonic() due time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in audit.WRITE_METHODS
            or not scope["path"].startswith(API_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        # Request.state is a view of scope["state"]: make sure it is this dict we read.
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as exc:
            # Usually nothing was answered yet: Starlette's outer error middleware
            # answers 500 after we re-raise.
            await self._record(scope, state, status or 500, f"error={type(exc).__name__}")
            raise
        except BaseException:
            # Cancelled (server shutdown): awaiting would be cancelled too, so the row is
            # handed to a worker thread without waiting for it.
            entry = self._entry_or_none(scope, state, status, "cancelled")
            if entry is not None:
                try:
                    asyncio.get_running_loop().run_in_executor(None, self._write_safely, entry)
                except Exception as exc:  # the executor is already shut down
                    _warn(scope, status, exc)
            raise
        await self._record(scope, state, status, "")

    async def _record(self, scope: Scope, state: dict[str, Any], status: int, extra: str) -> None:
        entry = self._entry_or_none(scope, state, status, extra)
        if entry is None:
            return
        try:
            await asyncio.to_thread(self._write_safely, entry)
        except Exception as exc:  # e.g. no worker thread at shutdown
            _warn(scope, status, exc)

    def _entry_or_none(
        self, scope: Scope, state: dict[str, Any], status: int, extra: str
    ) -> audit.AuditEntry | None:
        try:
            return self._entry(scope, state, status, extra)
        except Exception as exc:
            _warn(scope, status, exc)
            return None

    def _entry(
        self, scope: Scope, state: dict[str, Any], status: int, extra: str
    ) -> audit.AuditEntry | None:
        path = str(scope["path"])
        actor = str(state.get("actor", ""))
        if is_machine_call(path, actor):
            return None
        principal = state.get("principal")
        client = scope.get("client")
        detail = [f"{k}={v}" for k, v in (scope.get("path_params") or {}).items()]
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        names = sorted({p.split("=", 1)[0] for p in query.split("&") if p})
        if names:  # names only: values are not needed to tell what was done
            detail.append("query=" + ",".join(names))
        if extra:
            detail.append(extra)
        return audit.AuditEntry(
            created_at=self.ctx.clock.now(),
            method=str(scope["method"]),
            path=path,
            status=status,
            remote_addr=str(client[0]) if client else "",
            user_id=principal.user_id if principal is not None else "",
            username=principal.username if principal is not None else "",
            tenant_id=principal.tenant_id if principal is not None else "",
            role=principal.role if principal is not None else actor,
            detail=" ".join(detail),
        )

    def _write_safely(self, entry: audit.AuditEntry) -> None:
        """In a worker thread: the row in its own unit of work, then (at most once per
        ``audit_prune_interval_s`` per process) the retention sweep in another, so a
        failed sweep never loses the row. Never raises: the answer is already decided."""
        try:
            with self.ctx.db.session() as s:
                audit.record(s, entry)
        except Exception as exc:
            _warn({"method": entry.method, "path": entry.path}, entry.status, exc)
        self._maybe_prune()

    def _maybe_prune(self) -> None:
        settings = self.ctx.settings
        if settings.audit_retention_days <= 0 or not self._prune_lock.acquire(blocking=False):
            return
        try:
            mono = self.ctx.clock.monotonic()
            if self._next_prune is not None and mono < self._next_prune:
                return
            self._next_prune = mono + settings.audit_prune_interval_s
            with self.ctx.db.session() as s:
                gone = audit.prune(s, self.ctx.clock.now(), settings.audit_retention_days)
            if gone:
                log.info(
                    "audit log: %d rows older than %d days deleted",
                    gone,
                    settings.audit_retention_days,
                )
        except Exception as exc:
            log.warning("audit retention sweep failed: %s", type(exc).__name__)
        finally:
            self._prune_lock.release()


def _warn(scope: Scope | dict[str, Any], status: int, exc: Exception) -> None:
    # the exception's type only: its text may quote the row's values
    log.warning(
        "audit record not written (%s %s -> %s): %s",
        scope.get("method"),
        audit.clean(str(scope.get("path", "")), 200),
        status,
        type(exc).__name__,
    )
