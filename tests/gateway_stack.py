"""The pieces of a real gateway stack that many test modules build the same way.

- ``start_engine``: the llama.cpp launcher (``python -m heteroflow.engines.llamacpp_server``)
  as a real subprocess on a free port, returned once ``/health`` answers 200. The
  ``Engine`` it returns stops the process when used as a context manager.
- ``target`` / ``snapshot``: a ``RoutingSnapshot`` with one key that may call every
  routed model, each model routed to one ``RouteTarget`` of ``Backend`` s.
- ``serve_gateway``: a ``GatewayApp`` on uvicorn in a background thread
  (``UvicornThread``), closed and stopped on exit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest

from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.wire.errors import Receive, Scope, Send
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from tests.conftest import free_port

LAUNCHER = [sys.executable, "-m", "heteroflow.engines.llamacpp_server"]
ALIAS = "heteroflow-tiny"


@dataclass
class Engine:
    """A running launcher process; ``with`` it to have it stopped afterwards."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    argv: list[str]

    def stop(self) -> None:
        """Terminate the process (kill it if it does not exit within 10 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RequestIdTap:
    """A fake engine that notes the x-request-id of every POST it gets."""

    def __init__(self, app: FakeOpenAIBackend) -> None:
        self.app = app
        self.request_ids: list[str | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            rid = dict(scope["headers"]).get(b"x-request-id")
            self.request_ids.append(None if rid is None else rid.decode())
        await self.app(scope, receive, send)


def start_engine(
    model: Path,
    log: Path,
    *extra: str,
    alias: str = ALIAS,
    slots: int | None = 2,
    ready_s: float = 30,
) -> Engine:
    """Start the launcher on ``model`` (``-np slots`` unless None, ``-t 1``, then ``extra``).

    Its stderr goes to ``log``: llama.cpp logs every request and a full pipe would stall it.
    """
    port = free_port()
    argv = [*LAUNCHER, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--alias", alias, *([] if slots is None else ["-np", str(slots)]), "-t", "1"]
    argv += extra
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink)
    engine = Engine(proc, f"http://127.0.0.1:{port}", log, argv)
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"launcher exited with {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=1).status_code == 200:
                return engine
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    pytest.fail(f"launcher not ready within {ready_s:g} s: {log.read_text()}")


def target(
    name: str,
    *urls: str,
    algorithm: str = "round_robin",
    capabilities: Capabilities = UNKNOWN,
) -> RouteTarget:
    """Route ``route-{name}`` of group ``group-{name}`` to one backend per URL."""
    tasks = [f"task-{name}"] if len(urls) == 1 else [f"task-{name}-{i}" for i in range(len(urls))]
    return RouteTarget(
        route_id=f"route-{name}",
        group_id=f"group-{name}",
        priority=0,
        weight=1,
        backends=tuple(Backend(task_id=t, base_url=u) for t, u in zip(tasks, urls, strict=True)),
        algorithm=algorithm,
        capabilities=capabilities,
    )


def snapshot(
    routes: Mapping[str, Sequence[str] | RouteTarget],
    *,
    key: str,
    tenant: str = "t1",
    capabilities: Capabilities = UNKNOWN,
) -> RoutingSnapshot:
    """One key (endpoint ``endpoint-1``) that may call every model in ``routes``; a model
    given URLs is routed by ``target(model, *urls, capabilities=capabilities)``."""
    if any(isinstance(to, str) for to in routes.values()):
        raise TypeError("a model's route is a RouteTarget or a sequence of URLs, not one URL")
    return RoutingSnapshot(
        version=1,
        keys={hash_key(key): KeyEntry("endpoint-1", tenant, None, frozenset(routes))},
        routes={
            (tenant, model): (
                to
                if isinstance(to, RouteTarget)
                else target(model, *to, capabilities=capabilities),
            )
            for model, to in routes.items()
        },
    )


@dataclass
class Served:
    """A gateway serving on 127.0.0.1."""

    app: GatewayApp
    port: int
    thread: UvicornThread

    @property
    def url(self) -> str:
        """The root URL (no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def serve_gateway(
    routing: SnapshotHolder | RoutingSnapshot,
    thread: UvicornThread | None = None,
    **app_kwargs: Any,
) -> Iterator[Served]:
    """Serve ``GatewayApp(holder, **app_kwargs)`` on ``thread`` (a new one when None,
    stopped on exit; a given one is left running for its owner to stop)."""
    holder = routing if isinstance(routing, SnapshotHolder) else SnapshotHolder(routing)
    own = thread is None
    loop = UvicornThread() if thread is None else thread
    app = GatewayApp(holder, **app_kwargs)
    try:
        yield Served(app, loop.serve(app), loop)
    finally:
        loop.call(app.aclose())
        if own:
            loop.stop()
