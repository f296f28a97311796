"""``heteroflow server``: builds the server (``heteroflow.server.ServerApp``: API,
controllers, gateway on one port) from the HETEROFLOW_* settings and serves it."""

from __future__ import annotations

import argparse
import asyncio
import sys

from heteroflow.cmd import instance_lock
from heteroflow.server import ServerApp, TlsFilesUnusable
from heteroflow.serving import bind, install_stop_signals, settle_heap
from heteroflow.settings import ServerSettings


def run(a: argparse.Namespace) -> int:
    given = {"host": a.host, "port": a.port, "tls_cert_file": a.tls_cert, "tls_key_file": a.tls_key}
    overrides = {k: v for k, v in given.items() if v is not None}
    settings = ServerSettings(**overrides)
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


async def _serve(settings: ServerSettings, lock: instance_lock.InstanceLock | None) -> None:
    app = ServerApp(settings)
    if app.bootstrap.admin_password_generated:
        print(f"admin password (shown once): {app.bootstrap.admin_password_generated}")
    if not settings.node_token:
        print(
            "node token: kept in the database (`heteroflow rotate-node-token --show` prints "
            "it; or set HETEROFLOW_NODE_TOKEN); agents need the same value"
        )
    sock = bind(settings.host, settings.port)
    scheme = "https" if settings.tls_cert_file is not None else "http"  # issue 18
    url = f"{scheme}://{settings.host}:{sock.getsockname()[1]}"
    if lock is not None:
        lock.describe(url)
    print(f"HeteroFlow server listening on {url}", flush=True)
    stop = asyncio.Event()
    install_stop_signals(stop)
    settle_heap()  # the server's gateway serves on this loop too
    await app.serve(stop, sock)
