"""``heteroflow gateway``: a separate gateway's process root — a server's routes (polled
over HTTP) or, standalone, routes from a file.

``--workers N`` (issue 31): N such gateways forked by a supervising parent that binds
the port once (``heteroflow.workers``: pre-fork, restarts, SIGTERM, SIGHUP) and shares one
table of requests in flight per backend between them (``routing.inflight``). N > 1
needs Redis (``HETEROFLOW_REDIS_URL``): rate limits, quotas and idempotency keys are
exact across processes only there, and a gateway that silently let each worker keep
its own would let a key through N times its limit. Without Redis the default is one
worker, the process of before.

Like the agent, it never loads the server, the database, the services, the API,
SQLAlchemy or FastAPI (`.importlinter`, tests/integration/test_process_roots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from heteroflow.core.clock import SystemClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.metrics_share import SharedMetrics
from heteroflow.gateway.policy.usage import (
    HttpUsageSink,
    JsonLinesUsageSink,
    UsageCollector,
    UsageSink,
)
from heteroflow.gateway.routing.inflight import InFlight, SharedInFlight
from heteroflow.gateway.routing.poller import SnapshotPoller
from heteroflow.gateway.routing.routes_file import RoutesFileError, RoutesFileWatcher
from heteroflow.logs import register_secrets
from heteroflow.schemas.routing import EMPTY_SNAPSHOT, SnapshotHolder
from heteroflow.serving import (
    bind,
    http_server,
    install_stop_signals,
    run_on_loop,
    settle_heap,
    shared_listener,
)
from heteroflow.settings import ServerSettings
from heteroflow.workers import (
    ACCEPT_BATCH,
    Supervisor,
    default_workers,
    redis_problem,
    say_ready_when,
    stop_accepting,
    worker_headers,
)

Source = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


def run(a: argparse.Namespace) -> int:
    if (a.server is None) == (a.routes is None):
        print("give --server URL or --routes FILE (standalone)", file=sys.stderr)
        return 2
    if a.usage_log and not a.routes:
        print("--usage-log is for --routes (a server gateway reports to it)", file=sys.stderr)
        return 2
    token = ""
    if a.server:
        token = a.token or os.environ.get("HETEROFLOW_GATEWAY_TOKEN", "")
        if not token:
            print("a gateway token is needed: --token or HETEROFLOW_GATEWAY_TOKEN", file=sys.stderr)
            return 2
        register_secrets(token)  # issue 18 (P3): never in a log line
    settings = ServerSettings()
    redis_url = settings.redis_url
    workers: int | None = getattr(a, "workers", None)
    if workers is None:
        workers = default_workers() if redis_url else 1
    problem = redis_problem(workers, redis_url)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    loop = settings.gateway_event_loop
    if workers == 1:
        return run_on_loop(_run_gateway(a, token), loop)
    return _run_workers(a, token, workers, loop)


def _run_workers(a: argparse.Namespace, token: str, workers: int, loop: str) -> int:
    """The parent of ``workers`` gateway processes (``heteroflow.workers.Supervisor``)."""

    def check() -> str | None:
        return _routes_problem(a.routes) if a.routes else None

    problem = check()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    sock = bind(a.host, a.port)
    table = SharedInFlight(2 * workers)  # a column per worker, old and new during a restart
    metrics_dir = Path(tempfile.mkdtemp(prefix="heteroflow-gateway-metrics-"))

    def child(column: int, ready_fd: int) -> int:
        inflight = table.for_worker(column)
        shared = (inflight, metrics_dir, ready_fd)
        return run_on_loop(_run_gateway(a, token, sock=sock, worker=shared), loop)

    def ready() -> None:
        url = f"http://{a.host}:{sock.getsockname()[1]}"
        print(f"HeteroFlow gateway listening on {url} ({workers} workers)", flush=True)

    supervisor = Supervisor(workers, child, on_dead=table.clear, check=check, on_stop=sock.close)
    try:
        return supervisor.run(on_ready=ready)
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _routes_problem(path: str) -> str | None:
    """Why the routing file does not load (None: it does)."""
    try:
        RoutesFileWatcher(Path(path), SnapshotHolder()).load()
    except RoutesFileError as exc:
        return str(exc)
    return None


def _routes_source(
    a: argparse.Namespace, token: str, settings: ServerSettings, holder: SnapshotHolder
) -> tuple[Source, UsageSink | None] | None:
    """Where the routes come from and where usage goes; None (said on stderr) when the
    routing file cannot be read."""
    if not a.routes:
        interval = settings.gateway_poll_interval_s
        poller = SnapshotPoller(a.server, token, holder, interval_s=interval)
        return poller.run, HttpUsageSink(a.server, token)
    # Standalone: routes from a file, no server; usage to a JSON-lines file or dropped.
    interval_s = settings.routes_reload_interval_s
    watcher = RoutesFileWatcher(Path(a.routes), holder, interval_s=interval_s)
    try:
        watcher.load()
    except RoutesFileError as exc:
        print(exc, file=sys.stderr)
        return None
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, watcher.request_reload)
    return watcher.run, (JsonLinesUsageSink(Path(a.usage_log)) if a.usage_log else None)


async def _run_gateway(
    a: argparse.Namespace,
    token: str,
    *,
    sock: socket.socket | None = None,
    worker: tuple[InFlight, Path, int] | None = None,
) -> int:
    """One gateway process: the whole gateway, or (``worker`` given: the shared in-flight
    table, the metrics directory, the ready pipe) one of the workers, serving ``sock``
    (bound by the parent)."""
    inflight, metrics_dir, ready_fd = worker if worker is not None else (None, None, None)
    settings = ServerSettings()
    holder = SnapshotHolder()
    found = _routes_source(a, token, settings, holder)
    if found is None:
        return 2
    source, sink = found
    usage = (
        None
        if sink is None
        else UsageCollector(
            sink,
            SystemClock(),
            interval_s=settings.usage_flush_interval_s,
            max_records=settings.usage_flush_max_records,
        )
    )
    # every gateway setting, as in the all-in-one (HETEROFLOW_REDIS_URL: limits and
    # idempotency keys shared with other gateways, M8, M9)
    app = GatewayApp.from_settings(settings, holder, usage=usage, inflight=inflight)
    if sock is None:
        sock = bind(a.host, a.port)
    stop = asyncio.Event()
    install_stop_signals(stop)
    if ready_fd is None:
        server = http_server(app, lifespan="off")
    else:  # a worker: its own descriptor of the shared socket, a few accepts per wake-up
        sock = shared_listener(sock)
        headers = worker_headers()
        server = http_server(app, lifespan="off", headers=headers, accept_batch=ACCEPT_BATCH)
    app.start()  # probes and scrapes follow the snapshot from now on
    background = [asyncio.create_task(source(stop))]
    if usage is not None:
        background.append(asyncio.create_task(usage.run(stop)))
    settle_heap()  # start-up is done: no GC pass walks its objects again
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    shared: SharedMetrics | None = None
    if metrics_dir is not None:
        shared = SharedMetrics(metrics_dir, app.metrics)
        app.render_metrics = shared.render
        background.append(asyncio.create_task(shared.run(stop)))
    if ready_fd is None:
        url = f"http://{a.host}:{sock.getsockname()[1]}"
        print(f"HeteroFlow gateway listening on {url}", flush=True)
    else:
        wait_s = 2 * settings.gateway_poll_interval_s + 5.0

        # ready once it serves and has routes (a server's first snapshot; a routing
        # file's are loaded before serving)
        def routed() -> bool:
            return holder.current is not EMPTY_SNAPSHOT

        background.append(asyncio.create_task(say_ready_when(server, ready_fd, wait_s, routed)))
    await stop.wait()
    if ready_fd is not None:
        await stop_accepting(server)
    server.should_exit = True
    await asyncio.gather(serving, *background, return_exceptions=True)
    if usage is not None:
        await usage.close()  # after the last request ended: nothing counted is lost
    await app.aclose()
    if shared is not None:
        shared.write()  # every request it answered stays in the workers' sum
    return 0
