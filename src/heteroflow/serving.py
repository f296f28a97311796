"""Serving a HeteroFlow process: the socket, uvicorn as every process runs it, signals.

A small module of its own so the edges (a separate gateway) can serve without loading
the server's database, services and controllers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
from collections.abc import Iterator
from typing import Any, Literal

import uvicorn


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: our process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: Any, *, lifespan: Literal["on", "off"] = "on") -> _Uvicorn:
    """uvicorn as every HeteroFlow process runs it.

    The stock asyncio loop (uvloop starved accept() under connection bursts in the
    gateway bench), httptools, no access log (the hot path must not log per request),
    and keep-alive longer than the gateway's 4 s upstream idle timeout.
    """
    return _Uvicorn(
        uvicorn.Config(
            app,
            loop="asyncio",
            http="httptools",
            lifespan=lifespan,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
        )
    )


class PortBusy(OSError):
    """The port a process was asked to serve on is taken: one line for the operator."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"{host}:{port} is already in use (another HeteroFlow, or another program): "
            "stop it, or choose another port with --port",
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket we own (port 0 works), handed to uvicorn.

    proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only
    for sockets that say so, and a socket made with proto 0 left Nagle on — every
    gateway response then waited ~40 ms for the client's delayed ACK (measured with
    bench/gateway.sh: 22 req/s at c=1). The listener sets it too, for good measure.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortBusy(host, port) from exc
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
