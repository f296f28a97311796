"""Serving a HeteroFlow process: the socket, uvicorn as every process runs it, signals,
and the garbage collector's and the GIL's settings for a process that serves.

A small module of its own so the edges (a separate gateway) can serve without loading
the server's database, services and controllers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Literal, TypeVar

import uvicorn

T = TypeVar("T")
# The listen queue of a socket we bind (``bind``): the connections the kernel holds for
# the process (or the workers) to accept.
LISTEN_BACKLOG = 2048

# The young generation's threshold for a serving process (CPython's default is 700).
GC_GEN0_THRESHOLD = 20_000
# How long a thread may keep the GIL while another waits for it, in a process whose
# threads both wait on I/O and compute (CPython's default is 5 ms).
GIL_SWITCH_INTERVAL_S = 0.001


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: our process owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(
    app: Any,
    *,
    lifespan: Literal["on", "off"] = "on",
    headers: list[tuple[str, str]] | None = None,
    accept_batch: int = LISTEN_BACKLOG,
) -> _Uvicorn:
    """uvicorn as every HeteroFlow process runs it (``headers``: added to every answer
    by uvicorn itself, e.g. a gateway worker's pid; ``accept_batch``: the most
    connections the event loop accepts per wake-up — asyncio takes the server's listen
    backlog, so the listener must be a ``SharedListener`` for anything but the default).

    The stock asyncio loop (uvloop starved accept() under connection bursts in the
    gateway bench), httptools, no access log (the hot path must not log per request),
    and keep-alive longer than the gateway's 4 s upstream idle timeout. Its loggers get
    no handlers of their own (``log_config=None``): their lines go through the process's
    one handler (``logs.py``: text or JSON, secrets redacted).

    On uvloop (a gateway that asks for it, ``run_on_loop``) the backlog is what it says —
    libuv calls listen(2) with it, on the socket the workers share — so it stays
    ``LISTEN_BACKLOG``,
    and an accept batch under it turns on libuv's own spreading instead
    (``UV_TCP_SINGLE_ACCEPT``: it yields to the other processes after each accept).
    """
    backlog = accept_batch
    if on_uvloop():
        if accept_batch < LISTEN_BACKLOG:
            os.environ["UV_TCP_SINGLE_ACCEPT"] = "1"  # read by libuv at listen time
        backlog = LISTEN_BACKLOG
    return _Uvicorn(
        uvicorn.Config(
            app,
            loop="asyncio",
            http="httptools",
            lifespan=lifespan,
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
            headers=headers,
            backlog=backlog,
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
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class SharedListener(socket.socket):
    """A listening socket one of several processes accepts from (a pre-forked gateway
    worker's copy): ``listen()`` is the parent's, once, so asyncio's call is ignored —
    it would set the shared queue's length to the accept batch."""

    def listen(self, backlog: int = 0, /) -> None:
        return None


def shared_listener(sock: socket.socket) -> SharedListener:
    """This process's own descriptor of ``sock``, as a ``SharedListener``."""
    dup = SharedListener(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
    dup.setblocking(False)
    return dup


def settle_heap() -> None:
    """Once start-up is done, before serving: keep the collector off the event loop.

    With CPython's defaults a busy gateway ran a full (generation 2) collection about
    once a second at c=32 and twice a second at c=450. Each one walked every object
    since import (~60,000) in 13-50 ms, and the event loop stood still meanwhile: the
    gateway's p99 under wrk was those stalls. The objects alive now (modules, settings,
    the app) live as long as the process, so they go to the permanent generation
    (``gc.freeze``), and no pass walks them again. A request's objects die by reference
    counting, not by the collector (no cycles per request). Collecting the young
    generation every 700 allocations only promoted the objects of requests in flight
    towards generation 2. Every 20,000 makes passes ~100x rarer. In docs/benchmarks.md
    the GC CPU fell by 85 %, the longest pause went from 45 to 15 ms at c=450, and
    c=32 ran no pass at all. The older generations keep their ratios.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def share_the_gil() -> None:
    """A server process (``heteroflow server``, ``up``): a thread that computes hands the
    GIL to a waiting one after 1 ms, not 5.

    The server's threads mostly wait — the event loop on its sockets, the heartbeat
    batches and controllers on PostgreSQL — and each wait ends by taking the GIL back.
    While one thread computed (the series sampler's round at 2,000 nodes: 0.2-0.5 s
    every 10 s), every such return waited up to a whole interval, several times per
    heartbeat: the heartbeats' p99 was that round. At 1 ms, one server at 2,000 agents
    answered with p99 24-27 ms against 36 ms at the default, at 3,000 44-63 against
    61-66, for the same CPU (``bench/control_plane.py``, docs/benchmarks.md). The
    gateway alone runs one thread: its setting stays CPython's."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def run_on_loop(main: Coroutine[Any, Any, T], loop: str = "asyncio") -> T:
    """``asyncio.run(main)`` on the loop named (``ServerSettings.gateway_event_loop``):
    "asyncio" or "uvloop" (an error that says so when it is not installed)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            main.close()
            raise RuntimeError(
                "HETEROFLOW_GATEWAY_EVENT_LOOP=uvloop, but uvloop is not installed "
                "(pip install uvloop, or leave the setting at asyncio)"
            ) from None
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def on_uvloop() -> bool:
    """Whether this thread runs an event loop, and it is uvloop's."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return type(loop).__module__.startswith("uvloop")


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
