"""``heteroflow gateway``: a separate gateway's process root — a server's routes (polled
over HTTP) or, standalone, routes from a file.

Like the agent, it never loads the server, the database, the services, the API,
SQLAlchemy or FastAPI (`.importlinter`, tests/integration/test_process_roots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from heteroflow.core.clock import SystemClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.policy.usage import (
    HttpUsageSink,
    JsonLinesUsageSink,
    UsageCollector,
    UsageSink,
)
from heteroflow.gateway.routing.poller import SnapshotPoller
from heteroflow.gateway.routing.routes_file import RoutesFileError, RoutesFileWatcher
from heteroflow.logs import register_secrets
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.serving import bind, http_server, install_stop_signals, settle_heap
from heteroflow.settings import ServerSettings

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
    return asyncio.run(_run_gateway(a, token))


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


async def _run_gateway(a: argparse.Namespace, token: str) -> int:
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
    app = GatewayApp.from_settings(settings, holder, usage=usage)
    sock = bind(a.host, a.port)
    stop = asyncio.Event()
    install_stop_signals(stop)
    server = http_server(app, lifespan="off")
    app.start()  # probes and scrapes follow the snapshot from now on
    background = [asyncio.create_task(source(stop))]
    if usage is not None:
        background.append(asyncio.create_task(usage.run(stop)))
    settle_heap()  # start-up is done: no GC pass walks its objects again
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    print(f"HeteroFlow gateway listening on http://{a.host}:{sock.getsockname()[1]}", flush=True)
    await stop.wait()
    server.should_exit = True
    await asyncio.gather(serving, *background, return_exceptions=True)
    if usage is not None:
        await usage.close()  # after the last request ended: nothing counted is lost
    await app.aclose()
    return 0
