"""``heteroflow server``: builds the server (``heteroflow.server.ServerApp``: API,
controllers, gateway on one port) from the HETEROFLOW_* settings and serves it.

``--workers N`` (issue 31): N server processes serving one port, forked by a supervising
parent that binds it once (``heteroflow.workers``: pre-fork, restarts, SIGTERM, SIGHUP),
and one more process for the fleet-wide loops (the scheduler and the leader-only
controllers: ``server.Role``), which serves nothing — each an instance on the one
database, as servers side by side are. The parent migrates the database and
bootstraps the first admin before forking (once, the admin password printed once); the
embedded gateways share one in-flight table (``routing.inflight``). N > 1 needs
PostgreSQL (SQLite takes one writer at a time, and a second process on the data
directory's file is what the instance lock refuses) and Redis (the embedded gateway's
rate limits, quotas and idempotency keys are exact across processes only there: the
rule of ``heteroflow gateway --workers``). The default is 1, the process of before: an
upgrade changes nothing, and N workers hold N + 1 pools of database connections (up to
20 each), which a PostgreSQL sized for one server may not have.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from heteroflow.cmd import instance_lock
from heteroflow.core.clock import SystemClock
from heteroflow.db.engine import driver_url
from heteroflow.gateway.routing.inflight import SharedInFlight
from heteroflow.logs import redact
from heteroflow.server import Role, ServerApp, Started, TlsFilesUnusable, start, tls_problem
from heteroflow.serving import bind, install_stop_signals, settle_heap, share_the_gil
from heteroflow.settings import ServerSettings
from heteroflow.workers import ProcessFiles, Supervisor, redis_problem


def run(a: argparse.Namespace) -> int:
    given = {"host": a.host, "port": a.port, "tls_cert_file": a.tls_cert, "tls_key_file": a.tls_key}
    overrides = {k: v for k, v in given.items() if v is not None}
    settings = ServerSettings(**overrides)
    workers: int = getattr(a, "workers", None) or 1
    if workers > 1:
        problem = workers_problem(settings, workers)
        if problem is not None:
            print(f"heteroflow server: {problem}", file=sys.stderr)
            return 2
    share_the_gil()  # this process's, and so each forked worker's
    if workers > 1:
        return _run_workers(settings, workers)
    lock = _lock(settings)
    try:
        asyncio.run(_serve(settings, lock))
    except TlsFilesUnusable as exc:  # issue 18: one line, not a traceback
        print(f"heteroflow server: {exc}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            lock.release()
    return 0


def workers_problem(settings: ServerSettings, workers: int) -> str | None:
    """Why ``--workers`` cannot be ``workers`` with these settings (None: it can)."""
    url = settings.database_url
    if not url or url.startswith("sqlite"):
        return (
            f"--workers {workers} needs PostgreSQL (HETEROFLOW_DATABASE_URL): SQLite takes "
            "one writer process at a time (else --workers 1)"
        )
    return redis_problem(workers, settings.redis_url) or tls_problem(settings)


def _lock(settings: ServerSettings) -> instance_lock.InstanceLock | None:
    """issue 33: a server on the data directory's own SQLite database holds the data
    directory's lock (the one `up` takes): a second one there, or an `up`, is refused.
    Servers on a shared database (PostgreSQL) are meant to run side by side (HA) and
    take none."""
    if settings.database_url:
        return None
    scheme = "https" if settings.tls_cert_file is not None else "http"
    url = f"{scheme}://{settings.host}:{settings.port}"
    return instance_lock.acquire(settings.data_dir, "server", url)


def _say_started(settings: ServerSettings, admin_password: str | None) -> None:
    if admin_password:
        print(f"admin password (shown once): {admin_password}")
    if not settings.node_token:
        print(
            "node token: kept in the database (`heteroflow rotate-node-token --show` prints "
            "it; or set HETEROFLOW_NODE_TOKEN); agents need the same value"
        )


def _url(settings: ServerSettings, port: int) -> str:
    scheme = "https" if settings.tls_cert_file is not None else "http"  # issue 18
    return f"{scheme}://{settings.host}:{port}"


async def _serve(settings: ServerSettings, lock: instance_lock.InstanceLock | None) -> None:
    app = ServerApp(settings)
    _say_started(settings, app.bootstrap.admin_password_generated)
    sock = bind(settings.host, settings.port)
    url = _url(settings, sock.getsockname()[1])
    if lock is not None:
        lock.describe(url)
    print(f"HeteroFlow server listening on {url}", flush=True)
    stop = asyncio.Event()
    install_stop_signals(stop)
    settle_heap()  # the server's gateway serves on this loop too
    await app.serve(stop, sock)


def restart_problem(settings: ServerSettings) -> str | None:
    """What a SIGHUP checks before it replaces the processes (the old ones go on serving
    when this says something, in one line): the TLS files as they are now — a SIGHUP is
    how a renewed certificate is taken, and new workers that cannot load it never serve —
    and the database answering, which every new process needs before it serves."""
    return tls_problem(settings) or database_problem(settings.resolved_database_url())


def database_problem(url: str, timeout_s: int = 5) -> str | None:
    """Why the database at ``url`` does not answer ``SELECT 1`` within ``timeout_s``
    (None: it does). The reason is the driver's first line, secrets redacted."""
    connect_args = {"connect_timeout": timeout_s} if url.startswith("postgresql") else {}
    engine = create_engine(driver_url(url), poolclass=NullPool, connect_args=connect_args)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        return f"the database does not answer: {redact(first)}"
    finally:
        engine.dispose()
    return None


def _run_workers(settings: ServerSettings, workers: int) -> int:
    """The parent of ``workers`` server processes (``heteroflow.workers.Supervisor``)."""
    started = start(settings, SystemClock())  # migrated and bootstrapped once, here
    _say_started(settings, started.bootstrap.admin_password_generated)
    started.db.dispose()  # no connection crosses the fork: each worker opens its own
    sock = bind(settings.host, settings.port)
    children = workers + 1  # the workers and the controllers' process
    # a column per child, old and new during a restart; the workers take the requests
    table = SharedInFlight(2 * children, serving=workers)
    # each process's counts, for the worker that answers GET /metrics (ProcessFiles)
    metrics_dir = Path(tempfile.mkdtemp(prefix="heteroflow-server-metrics-"))

    def child(column: int, ready_fd: int) -> int:
        # slot 0 (``column % children``, kept by a replacement): the controllers' process
        role: Role = "controllers" if column % children == 0 else "requests"
        inflight = table.for_worker(column)
        files = ProcessFiles(metrics_dir)
        asyncio.run(_serve_worker(settings, started, sock, inflight, role, ready_fd, files))
        return 0

    def ready() -> None:
        url = _url(settings, sock.getsockname()[1])
        print(
            f"HeteroFlow server listening on {url} ({workers} workers, and a process "
            "for the controllers)",
            flush=True,
        )

    supervisor = Supervisor(
        children,
        child,
        on_dead=table.clear,
        check=lambda: restart_problem(settings),
        on_stop=sock.close,
        name="server",
    )
    try:
        return supervisor.run(on_ready=ready)
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve_worker(
    settings: ServerSettings,
    started: Started,
    sock: socket.socket,
    inflight: SharedInFlight,
    role: Role,
    ready_fd: int,
    files: ProcessFiles,
) -> None:
    """One child: a worker serving the parent's socket, or the controllers' process."""
    app = ServerApp(settings, started=started, inflight=inflight, role=role)
    app.share_metrics(files)
    stop = asyncio.Event()
    install_stop_signals(stop)
    settle_heap()
    if role == "controllers":
        await app.run_loops(stop, sock, ready_fd)
    else:
        await app.serve(stop, sock, ready_fd=ready_fd)
