"""Composition root: builds the server (API + controllers + gateway) and runs processes.

``ServerApp`` wires the database, services, the FastAPI app, the gateway and the
controllers together; ``serve`` runs uvicorn on a socket we bind ourselves (so port 0
works for tests) beside the controller loops, and stops everything on one event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Literal

import uvicorn

from heteroflow.api.app import Dispatcher, create_api
from heteroflow.api.context import ServerContext
from heteroflow.controllers.base import run_loop
from heteroflow.controllers.node_watch import NodeWatch
from heteroflow.controllers.scheduler import Scheduler
from heteroflow.controllers.snapshot import SnapshotPublisher
from heteroflow.core.clock import Clock, SystemClock
from heteroflow.db.engine import Database, migrate
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.snapshot import SnapshotHolder
from heteroflow.gateway.store import open_store
from heteroflow.gateway.usage import UsageCollector
from heteroflow.services.auth import Bootstrap, Tokens, bootstrap, shared_secret
from heteroflow.services.usage import DbUsageSink
from heteroflow.settings import ServerSettings

log = logging.getLogger(__name__)


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
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServerApp:
    def __init__(self, settings: ServerSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = Database.from_url(settings.resolved_database_url())
        migrate(self.db.engine)
        self.bootstrap: Bootstrap = bootstrap(self.db, self.clock, settings.admin_password)
        self.node_token = shared_secret(self.db, "node_token", settings.node_token)
        self.gateway_token = shared_secret(self.db, "gateway_token", settings.gateway_token)
        tokens = Tokens(
            shared_secret(self.db, "jwt_secret", settings.jwt_secret),
            settings.jwt_ttl_s,
            self.clock,
        )
        self.holder = SnapshotHolder()
        self.ctx = ServerContext(
            settings=settings,
            db=self.db,
            clock=self.clock,
            tokens=tokens,
            holder=self.holder,
            node_token=self.node_token,
            gateway_token=self.gateway_token,
        )
        self.usage = UsageCollector(
            DbUsageSink(self.db),
            self.clock,
            interval_s=settings.usage_flush_interval_s,
            max_records=settings.usage_flush_max_records,
        )
        self.gateway = GatewayApp(
            self.holder,
            usage=self.usage,
            models_cache_ttl_s=settings.models_cache_ttl_s,
            upstream_timeout_s=settings.upstream_timeout_s,
            max_card_temp_c=settings.gateway_max_card_temp_c,
            probe_interval_s=settings.gateway_probe_interval_s,
            probe_timeout_s=settings.gateway_probe_timeout_s,
            scrape_interval_s=settings.gateway_scrape_interval_s,
            auto_long_prompt_tokens=settings.gateway_auto_long_prompt_tokens,
            store=open_store(settings.redis_url, settings.redis_key_prefix),
            clock=self.clock,
        )
        self.asgi = Dispatcher(self.gateway, create_api(self.ctx))
        self.scheduler = Scheduler(
            self.db,
            self.clock,
            interval_s=settings.scheduler_interval_s,
            offline_after_s=settings.node_offline_after_s,
            port_pool=settings.port_pool(),
            reservation=settings.reservation(),
            policy=settings.placement_policy(),
            workers=settings.scheduler_workers,
        )
        self.node_watch = NodeWatch(
            self.db,
            self.clock,
            interval_s=settings.scheduler_interval_s,
            offline_after_s=settings.node_offline_after_s,
        )
        self.publisher = SnapshotPublisher(
            self.db, self.holder, interval_s=settings.snapshot_interval_s
        )

    async def serve(
        self,
        stop: asyncio.Event,
        sock: socket.socket,
        *,
        extra: list[Callable[[asyncio.Event], Coroutine[Any, Any, None]]] | None = None,
    ) -> None:
        server = http_server(self.asgi)
        loops = [
            asyncio.create_task(run_loop(self.scheduler, self.clock, stop)),
            asyncio.create_task(run_loop(self.node_watch, self.clock, stop)),
            asyncio.create_task(run_loop(self.publisher, self.clock, stop)),
            asyncio.create_task(self.usage.run(stop)),  # periodic usage batches (M7)
        ]
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        extras = [asyncio.create_task(fn(stop)) for fn in (extra or [])]
        await stop.wait()
        # extras first (the in-process agent stops its engines while the API still answers)
        await asyncio.gather(*extras, return_exceptions=True)
        server.should_exit = True
        await asyncio.gather(serving, *loops, return_exceptions=True)
        # After the last request ended: nothing counted is lost.
        await self.usage.close()
        await self.gateway.aclose()
        self.db.dispose()


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
