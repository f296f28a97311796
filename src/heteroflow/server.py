"""Composition root: builds the server (API + controllers + gateway) and runs processes.

``start`` opens the database, migrates it, bootstraps the first admin and reads the
shared secrets; ``ServerApp`` wires the services, the FastAPI app, the gateway and the
controller table (``controllers.table``) together; ``serve`` runs uvicorn on a socket
we bind ourselves (so port 0 works for tests) beside one loop per controller, and stops
everything on one event.

``heteroflow server --workers N`` (issue 31) forks, with ``heteroflow.workers.Supervisor``,
N processes serving one socket (``role="requests"``) and one that runs the fleet-wide
loops and serves nothing (``role="controllers"``): ``Role`` says which loop runs where.
Each is an instance of its own (its row in ``GET /servers``); the embedded gateways of
the workers share one in-flight table (``inflight``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from heteroflow.api import heartbeat_fast
from heteroflow.api.app import Dispatcher, create_api
from heteroflow.api.context import ServerContext
from heteroflow.api.heartbeat_fast import HeartbeatFastPath
from heteroflow.api.routes import nodes as nodes_routes
from heteroflow.controllers.base import Controller, run_loop
from heteroflow.controllers.idle import EmbeddedServerLink
from heteroflow.controllers.table import build, elect
from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.engine_access import ENGINE_KEY_SECRET, engine_key
from heteroflow.db.engine import Database, migrate
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.metrics_share import gateway_state, render_sum
from heteroflow.gateway.policy.usage import UsageCollector
from heteroflow.gateway.routing.inflight import InFlight
from heteroflow.logs import register_secrets
from heteroflow.private_files import private_dir
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.services.agents.node_tokens import NodeTokens
from heteroflow.services.identity.auth import (
    JWT_SECRET_KEY,
    Bootstrap,
    Tokens,
    bootstrap,
    shared_secret,
)
from heteroflow.services.metrics import LeaderState, ServerMetrics, read_fleet_counts
from heteroflow.services.tenancy.registry_credentials import Sealer
from heteroflow.services.tenancy.usage import DbUsageSink
from heteroflow.serving import http_server, shared_listener
from heteroflow.settings import ServerSettings
from heteroflow.workers import (
    ACCEPT_BATCH,
    ProcessFiles,
    say_ready,
    say_ready_when,
    stop_accepting,
    worker_headers,
)

log = logging.getLogger(__name__)

# What a process of the server runs (issue 31): "all", the one process of before;
# with --workers N, "requests" in each of the N workers serving the port and
# "controllers" in the one process kept for the fleet-wide loops. Those loops (the
# scheduler, the leader-only ones) read the whole fleet in rounds that hold the GIL for
# tens of milliseconds at 2,000 nodes: in a worker that also answers heartbeats they
# were that worker's tail (bench/control_plane.py: p99 20 ms in one worker, 103 in the
# one running them). A "requests" worker never bids for the lease.
Role = Literal["all", "controllers", "requests"]
# the loops of a "requests" worker: its row in server_instances (not a bid), its
# gateway's routing snapshot, and the rollouts it took (a PUT .../update it answered)
REQUEST_LOOPS = frozenset({"leader-election", "snapshot", "rollouts"})
# the loops the "controllers" process leaves out: it serves no gateway
NOT_CONTROLLER_LOOPS = frozenset({"snapshot"})
# A worker that has not said it is ready by then is counted ready anyway (a restart
# stops the old generation only then).
WORKER_READY_WAIT_S = 30.0


def runs_loop(role: Role, name: str) -> bool:
    """Whether a process of ``role`` runs the controller ``name``."""
    if role == "requests":
        return name in REQUEST_LOOPS
    if role == "controllers":
        return name not in NOT_CONTROLLER_LOOPS
    return True


class TlsFilesUnusable(ValueError):
    """The server's TLS certificate or key cannot be read or do not match (issue 18)."""


@dataclass(frozen=True)
class Started:
    """A migrated, bootstrapped database and the secrets every instance shares."""

    db: Database
    bootstrap: Bootstrap
    node_tokens: NodeTokens  # issue 18: the agents' tokens (the previous one too)
    gateway_token: str
    engine_key: Callable[[str], str]  # C14: every engine key derives from one secret
    tokens: Tokens
    # H7: registry passwords sealed under a key derived from the same platform secret
    sealer: Sealer


def tls_problem(settings: ServerSettings) -> str | None:
    """Why the TLS certificate and key cannot serve (None: they can, or no TLS): a
    parent of workers checks before forking, as ``serve`` does before serving."""
    if settings.tls_cert_file is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file or ""))
    except (OSError, ssl.SSLError) as exc:
        return f"HETEROFLOW_TLS_CERT_FILE / HETEROFLOW_TLS_KEY_FILE: {exc}"
    return None


def start(settings: ServerSettings, clock: Clock) -> Started:
    """Migrate, bootstrap the first admin and read (or make) the shared secrets."""
    private_dir(settings.data_dir)
    db = Database.from_url(settings.resolved_database_url())
    migrate(db.engine)
    boot = bootstrap(db, clock, settings.admin_password)
    # the node tokens agents may present (the previous one too, during a rotation:
    # `heteroflow rotate-node-token`); the API's agent routes check them
    node_tokens = NodeTokens(
        db,
        clock,
        preset=settings.node_token,
        preset_previous=settings.node_token_previous,
        cache_s=settings.node_token_cache_s,
    )
    gateway_token = shared_secret(db, "gateway_token", settings.gateway_token)
    engine_secret = shared_secret(db, ENGINE_KEY_SECRET)
    register_secrets(  # issue 18 (P3): never in a log line, wherever they appear
        engine_secret,
        node_tokens.current, settings.node_token, settings.node_token_previous,
        gateway_token, settings.jwt_secret, settings.admin_password,
        boot.admin_password_generated or "",
    )
    # A preset secret (HETEROFLOW_JWT_SECRET) is fixed; else the stored one is re-read
    # every jwt_secret_cache_s, so `heteroflow rotate-jwt-secret` reaches this instance.
    tokens = Tokens(
        settings.jwt_secret or partial(shared_secret, db, JWT_SECRET_KEY),
        settings.jwt_ttl_s,
        clock,
        secret_cache_s=settings.jwt_secret_cache_s,
    )
    return Started(
        db, boot, node_tokens, gateway_token, partial(engine_key, engine_secret), tokens,
        Sealer(engine_secret),
    )


class ServerApp:
    """The server's parts, wired. Built from ``start``'s result (by default it calls
    ``start`` itself: every caller and test builds it ready to answer)."""

    def __init__(
        self, settings: ServerSettings, clock: Clock | None = None,
        started: Started | None = None, *,
        inflight: InFlight | None = None, role: Role = "all",
    ) -> None:
        self.settings = settings
        self.role = role
        self._metrics_files: ProcessFiles | None = None  # server --workers N: shared
        self.clock = clock = clock or SystemClock()
        st = started or start(settings, clock)
        self.db, self.bootstrap, self.node_tokens = st.db, st.bootstrap, st.node_tokens
        self.node_token, self.gateway_token = st.node_tokens.current, st.gateway_token
        self.engine_key = st.engine_key
        self.sealer = st.sealer
        self.holder = SnapshotHolder()
        self.leadership = leadership = elect(settings, self.db, clock, bids=role != "requests")
        table = self.controllers = build(
            settings, self.db, clock, leadership, holder=self.holder, engine_key=self.engine_key
        )
        # the controllers by name (tests drive their rounds)
        self.scheduler, self.node_watch = table.scheduler, table.node_watch
        self.publisher, self.wakes, self.recovery = table.publisher, table.wakes, table.recovery
        self.idle, self.autoscaler, self.windows = table.idle, table.autoscaler, table.windows
        self.scale_drainer, self.rollouts = table.scale_drainer, table.rollouts
        self.usage = UsageCollector(
            DbUsageSink(self.db, clock),  # issue 14: the clock stamps load reports
            clock,
            interval_s=settings.usage_flush_interval_s,
            max_records=settings.usage_flush_max_records,
        )
        self.gateway = GatewayApp.from_settings(
            settings, self.holder, usage=self.usage, clock=clock, inflight=inflight
        )
        # F4, F6: the embedded gateway wakes sleeping services in this process
        self.gateway.hold.link = EmbeddedServerLink(
            self.db, clock, self.publisher, offline_after_s=settings.node_offline_after_s
        )
        self._wire_http(st.tokens)

    def _wire_http(self, tokens: Tokens) -> None:
        """The API, its fast heartbeat path and the metrics, behind one ASGI app with
        the gateway."""
        settings, clock = self.settings, self.clock
        self.ctx = ServerContext(
            settings=settings, db=self.db, clock=clock, tokens=tokens, holder=self.holder,
            node_token=self.node_token, gateway_token=self.gateway_token,
            engine_key=self.engine_key, sealer=self.sealer,
        )
        # issue 18 (P3): the server's metrics, on /metrics after the gateway's
        self.metrics = ServerMetrics(
            fleet=partial(read_fleet_counts, self.db, clock, settings.node_offline_after_s),
            leader=self._leader_state,
            refresh_s=settings.metrics_fleet_refresh_s,
            monotonic=clock.monotonic,
        )
        self.scheduler.on_round = self.metrics.scheduler_round
        api = create_api(self.ctx, self.metrics)
        # J1-J4: a PUT .../update takes its rollout's lease for this instance
        api.state.instance_id = self.leadership.holder
        api.state.node_tokens = self.node_tokens  # issue 18 (api/deps.get_node_id)
        self.heartbeats = HeartbeatFastPath(
            api, self.ctx, nodes_routes.heartbeat_work, self.metrics
        )
        self.asgi = Dispatcher(
            self.gateway, api, metrics=self._metrics_text,
            fast={("POST", heartbeat_fast.PATH): self.heartbeats},
        )

    def _leader_state(self) -> LeaderState:  # issue 18 (P3)
        return self.leadership.epoch(self.clock.now()), self.leadership.holder

    def _loop(self, controller: Controller, stop: asyncio.Event) -> asyncio.Task[None]:
        """A controller's loop, its rounds counted in the metrics (issue 18, P3)."""
        return asyncio.create_task(
            run_loop(controller, self.clock, stop, self.leadership, self.metrics)
        )

    async def _metrics_text(self) -> bytes:  # issue 18 (P3): GET /metrics on this port
        files = self._metrics_files
        if files is None:
            return self.gateway.metrics.render() + await asyncio.to_thread(self.metrics.render)
        # server --workers N: a scrape reaches one worker; it answers for every process
        others = await asyncio.to_thread(files.others)
        gateway = render_sum(self.gateway.metrics, [(s["gateway"], a) for s, a in others])
        server = await asyncio.to_thread(self.metrics.render, [(s["server"], a) for s, a in others])
        return gateway + server

    def share_metrics(self, files: ProcessFiles) -> None:
        """One of the processes of ``server --workers N``: ``/metrics`` answers the sum
        of every process's counts (each writes its own to ``files`` once a second —
        the controllers' process too, whose scheduler and loops no scrape reaches)."""
        self._metrics_files = files

    def _metrics_state(self) -> dict[str, object]:
        return {"gateway": gateway_state(self.gateway.metrics), "server": self.metrics.state()}

    def _write_metrics(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        files = self._metrics_files
        if files is None:
            return []
        return [asyncio.create_task(files.run(stop, self._metrics_state))]

    async def serve(
        self,
        stop: asyncio.Event,
        sock: socket.socket,
        *,
        extra: list[Callable[[asyncio.Event], Coroutine[Any, Any, None]]] | None = None,
        ready_fd: int | None = None,
    ) -> None:
        """Serve ``sock`` until ``stop``; ``ready_fd`` given: as a worker of
        ``heteroflow.workers.Supervisor`` (its pid on every answer, its own descriptor
        of the parent's socket, ready said once serving, a stop that first stops
        accepting)."""
        worker = ready_fd is not None
        if worker:
            sock = shared_listener(sock)
            server = http_server(self.asgi, headers=worker_headers(), accept_batch=ACCEPT_BATCH)
        else:
            server = http_server(self.asgi)
        if self.settings.tls_cert_file is not None:  # issue 18: https on this port
            server.config.ssl_certfile = str(self.settings.tls_cert_file)
            server.config.ssl_keyfile = str(self.settings.tls_key_file or "")
            try:
                server.config.load()  # reads them now: a bad file stops the start
            except (OSError, ssl.SSLError) as exc:
                raise TlsFilesUnusable(
                    f"HETEROFLOW_TLS_CERT_FILE / HETEROFLOW_TLS_KEY_FILE: {exc}"
                ) from exc
        self.gateway.start()  # probes and scrapes follow the snapshot from now on
        host, port = sock.getsockname()[:2]
        self.leadership.listening_on(str(host), int(port))
        # one loop per row of the table, the elector first
        loops = [self._loop(c, stop) for c in self.controllers if runs_loop(self.role, c.name)]
        loops.append(asyncio.create_task(self.usage.run(stop)))  # usage batches (M7)
        loops.extend(self._write_metrics(stop))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        extras = [asyncio.create_task(fn(stop)) for fn in (extra or [])]
        if ready_fd is not None:
            ready = say_ready_when(server, ready_fd, WORKER_READY_WAIT_S)
            loops.append(asyncio.create_task(ready))
        await stop.wait()
        if worker:  # the other workers take what is queued on the socket meanwhile
            await stop_accepting(server)
        # extras first (the in-process agent stops its engines while the API still answers)
        await asyncio.gather(*extras, return_exceptions=True)
        server.should_exit = True
        await asyncio.gather(serving, *loops, return_exceptions=True)
        await self._close()

    async def run_loops(self, stop: asyncio.Event, sock: socket.socket, ready_fd: int) -> None:
        """The "controllers" process of a server with workers: its loops until ``stop``,
        serving nothing (``sock``: the workers' socket, for its row in GET /servers)."""
        host, port = sock.getsockname()[:2]
        self.leadership.listening_on(str(host), int(port))
        loops = [self._loop(c, stop) for c in self.controllers if runs_loop(self.role, c.name)]
        loops.extend(self._write_metrics(stop))
        say_ready(ready_fd)
        await stop.wait()
        await asyncio.gather(*loops, return_exceptions=True)
        await self._close()

    async def _close(self) -> None:
        """After the loops and the requests ended."""
        # The leader-only loops have stopped: hand the lease over now rather than
        # making the next leader wait out the TTL.
        try:
            await asyncio.to_thread(self.leadership.release, self.clock.now())
        except Exception:
            log.exception("could not release the lease; it lapses after its TTL")
        # After the last request ended: nothing counted is lost.
        await self.usage.close()
        if self._metrics_files is not None:  # every count of this process stays in the sum
            with contextlib.suppress(OSError):
                self._metrics_files.write(self._metrics_state())
        await self.gateway.aclose()
        self.heartbeats.close()
        self.db.dispose()
