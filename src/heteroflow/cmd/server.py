"""``heteroflow server``: builds the server (``heteroflow.server.ServerApp``: API,
controllers, gateway on one port) from the HETEROFLOW_* settings and serves it."""

from __future__ import annotations

import argparse
import asyncio
import sys

from heteroflow.server import ServerApp, TlsFilesUnusable
from heteroflow.serving import bind, install_stop_signals, settle_heap
from heteroflow.settings import ServerSettings


def run(a: argparse.Namespace) -> int:
    given = {"host": a.host, "port": a.port, "tls_cert_file": a.tls_cert, "tls_key_file": a.tls_key}
    overrides = {k: v for k, v in given.items() if v is not None}
    try:
        asyncio.run(_serve(ServerSettings(**overrides)))
    except TlsFilesUnusable as exc:  # issue 18: one line, not a traceback
        print(f"heteroflow server: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve(settings: ServerSettings) -> None:
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
    print(
        f"HeteroFlow server listening on {scheme}://{settings.host}:{sock.getsockname()[1]}",
        flush=True,
    )
    stop = asyncio.Event()
    install_stop_signals(stop)
    settle_heap()  # the server's gateway serves on this loop too
    await app.serve(stop, sock)
