"""Composition root: builds the server (API + controllers + gateway) and runs processes.

``ServerApp`` wires the database, services, the FastAPI app, the gateway and the
controllers together; ``serve`` runs uvicorn on a socket we bind ourselves (so port 0
works for tests) beside the controller loops, and stops everything on one event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import ssl
from collections.abc import Callable, Coroutine
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from heteroflow.api import heartbeat_fast
from heteroflow.api.app import Dispatcher, create_api
from heteroflow.api.context import ServerContext
from heteroflow.api.heartbeat_fast import HeartbeatFastPath
from heteroflow.api.routes import nodes as nodes_routes
from heteroflow.controllers.autoscaler import Autoscaler, ScaleDrainer  # issue 14 (I1, I2)
from heteroflow.controllers.base import Controller, run_loop
from heteroflow.controllers.idle import EmbeddedServerLink, IdleSleeper  # issue 13 (F4, F6)
from heteroflow.controllers.leadership import Leadership
from heteroflow.controllers.node_watch import NodeWatch
from heteroflow.controllers.recovery import Recovery  # issue 13
from heteroflow.controllers.rollout import Rollouts  # issue 14
from heteroflow.controllers.scheduler import Scheduler
from heteroflow.controllers.snapshot import SnapshotPublisher
from heteroflow.controllers.wakes import WakeRetrier
from heteroflow.controllers.windows import WindowExecutor  # issue 14 (K1)
from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.engine_access import ENGINE_KEY_SECRET, engine_key
from heteroflow.core.recovery import RecoveryPolicy  # issue 13
from heteroflow.db.engine import Database, migrate
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.usage import UsageCollector
from heteroflow.logs import register_secrets
from heteroflow.private_files import private_dir
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.services.auth import (
    JWT_SECRET_KEY,
    Bootstrap,
    NodeTokens,
    Tokens,
    bootstrap,
    shared_secret,
)
from heteroflow.services.leadership import DbLeaseStore, InstanceInfo
from heteroflow.services.metrics import LeaderState, ServerMetrics, read_fleet_counts
from heteroflow.services.rollout import gateway_reports  # issue 14 (J1)
from heteroflow.services.usage import DbUsageSink
from heteroflow.services.windows import window_scaler  # issue 14 (K1)
from heteroflow.serving import http_server
from heteroflow.settings import ServerSettings

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return version("heteroflow")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return ""


class TlsFilesUnusable(ValueError):
    """The server's TLS certificate or key cannot be read or do not match (issue 18)."""


class ServerApp:
    def __init__(self, settings: ServerSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        private_dir(settings.data_dir)
        self.db = Database.from_url(settings.resolved_database_url())
        migrate(self.db.engine)
        self.bootstrap: Bootstrap = bootstrap(self.db, self.clock, settings.admin_password)
        # issue 18: the node tokens agents may present (the previous one too, during a
        # rotation: `heteroflow rotate-node-token`); the API's agent routes check them
        self.node_tokens = NodeTokens(
            self.db,
            self.clock,
            preset=settings.node_token,
            preset_previous=settings.node_token_previous,
            cache_s=settings.node_token_cache_s,
        )
        self.node_token = self.node_tokens.current
        self.gateway_token = shared_secret(self.db, "gateway_token", settings.gateway_token)
        # C14: every engine key derives from it (core.engine_access.engine_key)
        engine_secret = shared_secret(self.db, ENGINE_KEY_SECRET)
        self.engine_key: Callable[[str], str] = partial(engine_key, engine_secret)
        register_secrets(  # issue 18 (P3): never in a log line, wherever they appear
            engine_secret,
            self.node_token, settings.node_token, settings.node_token_previous,
            self.gateway_token, settings.jwt_secret, settings.admin_password,
            self.bootstrap.admin_password_generated or "",
        )
        # A preset secret (HETEROFLOW_JWT_SECRET) is fixed; else the stored one is re-read
        # every jwt_secret_cache_s, so `heteroflow rotate-jwt-secret` reaches this instance.
        tokens = Tokens(
            settings.jwt_secret or partial(shared_secret, self.db, JWT_SECRET_KEY),
            settings.jwt_ttl_s,
            self.clock,
            secret_cache_s=settings.jwt_secret_cache_s,
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
            engine_key=self.engine_key,
        )
        self.usage = UsageCollector(
            DbUsageSink(self.db, self.clock),  # issue 14: the clock stamps load reports
            self.clock,
            interval_s=settings.usage_flush_interval_s,
            max_records=settings.usage_flush_max_records,
        )
        self.gateway = GatewayApp.from_settings(
            settings, self.holder, usage=self.usage, clock=self.clock
        )
        # issue 18 (P3): the server's metrics, on /metrics after the gateway's
        self.metrics = ServerMetrics(
            fleet=partial(read_fleet_counts, self.db, self.clock, settings.node_offline_after_s),
            leader=self._leader_state,
            refresh_s=settings.metrics_fleet_refresh_s,
            monotonic=self.clock.monotonic,
        )
        api = create_api(self.ctx, self.metrics)
        heartbeat = self.heartbeats = HeartbeatFastPath(
            api, self.ctx, nodes_routes.heartbeat_work, self.metrics
        )
        self.asgi = Dispatcher(
            self.gateway, api, metrics=self._metrics_text,
            fast={("POST", heartbeat_fast.PATH): heartbeat},
        )
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
        self.scheduler.on_round = self.metrics.scheduler_round  # issue 18 (P3)
        # The elector: this instance's row in server_instances and its bid for the
        # lease the leader-only loops run under (a new id at every start).
        instance_id = f"srv-{secrets.token_hex(6)}"
        self.leadership = Leadership(
            DbLeaseStore(self.db),
            holder=instance_id,
            ttl_s=settings.leader_lease_ttl_s,
            interval_s=settings.leader_renew_interval_s,
            instance=InstanceInfo(
                id=instance_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                started_at=self.clock.now(),
                version=_version(),
            ),
        )
        # --- issue 14: rollouts (J1-J4) are driven by the instance whose PUT .../update
        # took their execution lease (this instance's id, which the route reads here) ---
        api.state.instance_id = instance_id
        api.state.node_tokens = self.node_tokens  # issue 18 (api/deps.get_node_id)
        self.rollouts = Rollouts(
            self.db,
            self.clock,
            instance_id,
            interval_s=settings.rollout_interval_s,
            scan_interval_s=settings.rollout_scan_interval_s,
            policy=settings.rollout_policy(),
            # drains end when every gateway reports nothing in flight on the replica
            in_flight=gateway_reports(self.clock, settings.gateway_load_stale_s),
        )
        # --- end issue 14 (rollouts) ---
        self.node_watch = NodeWatch(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.scheduler_interval_s,
            offline_after_s=settings.node_offline_after_s,
        )
        # --- issue 13: the recovery loop (E1-E4, A10; leader-only) ---
        self.recovery = Recovery(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.recovery_interval_s,
            policy=RecoveryPolicy(
                max_rebuilds=settings.recovery_max_rebuilds,
                stable_s=settings.recovery_stable_s,
                fallback_after=settings.recovery_fallback_after,
                disruption_threshold=settings.node_disruption_threshold,
            ),
            offline_after_s=settings.node_offline_after_s,
            migrate_after_s=settings.node_migrate_after_s,
        )
        # --- end issue 13 (recovery) ---
        self.publisher = SnapshotPublisher(
            self.db, self.holder, interval_s=settings.snapshot_interval_s,
            engine_key=self.engine_key,
        )
        # F3: wakes that had to wait for their node or their cards (leader-only)
        self.wakes = WakeRetrier(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.wake_retry_interval_s,
            offline_after_s=settings.node_offline_after_s,
            node_lost_after_s=settings.wake_node_lost_after_s,
        )
        # --- issue 13 (F4, F6): the embedded gateway wakes sleeping services in this
        # process (and refreshes the snapshot at once); the leader's idle timer ---
        self.gateway.wake.link = EmbeddedServerLink(
            self.db, self.clock, self.publisher, offline_after_s=settings.node_offline_after_s
        )
        self.idle = IdleSleeper(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.idle_check_interval_s,
            minute_s=settings.idle_minute_s,
            on_slept=self.publisher.refresh,
        )
        # --- end issue 13 (F4, F6) ---
        # --- issue 14 (I1, I2): the autoscaler and the end of scale-ins (leader-only) ---
        self.autoscaler = Autoscaler(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.autoscale_interval_s,
            min_age_s=settings.autoscale_min_age_s,
            load_stale_s=settings.gateway_load_stale_s,
        )
        self.scale_drainer = ScaleDrainer(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.scale_drain_interval_s,
            drain_timeout_s=settings.scale_drain_timeout_s,
            load_stale_s=settings.gateway_load_stale_s,
        )
        # --- end issue 14 (scaling) ---
        # issue 14 (K1): the schedule-window executor (leader-only)
        self.windows = WindowExecutor(
            self.db,
            self.clock,
            self.leadership,
            interval_s=settings.schedule_window_interval_s,
            scaler=window_scaler,
            offline_after_s=settings.node_offline_after_s,
            on_change=self.publisher.refresh,
        )

    def _leader_state(self) -> LeaderState:  # issue 18 (P3)
        return self.leadership.epoch(self.clock.now()), self.leadership.holder

    def _loop(self, controller: Controller, stop: asyncio.Event) -> asyncio.Task[None]:
        """A controller's loop, its rounds counted in the metrics (issue 18, P3)."""
        return asyncio.create_task(
            run_loop(controller, self.clock, stop, self.leadership, self.metrics)
        )

    async def _metrics_text(self) -> bytes:  # issue 18 (P3): GET /metrics on this port
        return self.gateway.metrics.render() + await asyncio.to_thread(self.metrics.render)

    async def serve(
        self,
        stop: asyncio.Event,
        sock: socket.socket,
        *,
        extra: list[Callable[[asyncio.Event], Coroutine[Any, Any, None]]] | None = None,
    ) -> None:
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
        # the elector first: leader-only loops skip their rounds until it holds the lease
        controllers = (
            self.leadership, self.scheduler, self.node_watch, self.publisher, self.wakes,
        )
        loops = [
            *(self._loop(c, stop) for c in controllers),
            asyncio.create_task(self.usage.run(stop)),  # periodic usage batches (M7)
        ]
        # issue 13: the recovery loop, beside the other controllers
        loops.append(self._loop(self.recovery, stop))
        # issue 13 (F4): the idle timer (leader-only)
        loops.append(self._loop(self.idle, stop))
        # issue 14 (I1, I2): the autoscaler and the end of scale-ins (leader-only)
        for scaling_loop in (self.autoscaler, self.scale_drainer):
            loops.append(self._loop(scaling_loop, stop))
        # issue 14 (K1): schedule windows (leader-only)
        loops.append(self._loop(self.windows, stop))
        # issue 14: the rollouts this instance holds, and the expiry scan (every instance)
        loops.append(self._loop(self.rollouts, stop))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        extras = [asyncio.create_task(fn(stop)) for fn in (extra or [])]
        await stop.wait()
        # extras first (the in-process agent stops its engines while the API still answers)
        await asyncio.gather(*extras, return_exceptions=True)
        server.should_exit = True
        await asyncio.gather(serving, *loops, return_exceptions=True)
        # The leader-only loops have stopped: hand the lease over now rather than
        # making the next leader wait out the TTL.
        try:
            await asyncio.to_thread(self.leadership.release, self.clock.now())
        except Exception:
            log.exception("could not release the lease; it lapses after its TTL")
        # After the last request ended: nothing counted is lost.
        await self.usage.close()
        await self.gateway.aclose()
        self.heartbeats.close()
        self.db.dispose()
