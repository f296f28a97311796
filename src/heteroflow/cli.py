"""Entry points: up | server | agent | gateway | migrate | login | services | ...

The `heteroflow` command; each sub-command delegates to `cmd/` or the process roots.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import signal
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from heteroflow.cmd.errors import CliError
from heteroflow.private_files import PRIVATE_UMASK
from heteroflow.serving import PortBusy
from heteroflow.settings import AgentSettings, LogSettings, ServerSettings, default_data_dir

if TYPE_CHECKING:
    from heteroflow.db.engine import Database


def _logging(verbose: bool) -> None:
    from pydantic import ValidationError

    from heteroflow.logs import configure

    try:  # issue 18 (P3): text (as before) or JSON lines; secrets redacted in both
        fmt = LogSettings().log_format
    except ValidationError:
        print("HETEROFLOW_LOG_FORMAT must be text or json", file=sys.stderr)
        raise SystemExit(2) from None
    configure(logging.DEBUG if verbose else logging.INFO, fmt)
    for noisy in ("httpx", "alembic", "gguf"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def _up(a: argparse.Namespace) -> int:
    from heteroflow.cmd.up import UpOptions, run_up

    data_dir = Path(a.data_dir).expanduser().resolve()
    models_dir = Path(a.models_dir).expanduser().resolve() if a.models_dir else data_dir / "models"
    opts = UpOptions(
        data_dir=data_dir,
        models_dir=models_dir,
        host=a.host,
        port=a.port,
        demo=a.demo,
        agent_config=Path(a.agent_config) if a.agent_config else None,
        threads=a.threads,
        runtime=a.runtime,
        port_range=a.port_range,
    )
    return asyncio.run(run_up(opts))


def port_range(text: str) -> tuple[int, int]:
    """``FIRST-LAST`` host ports (1024-65535, FIRST <= LAST), for ``up --port-range``."""
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = -1
    if not sep or not 1024 <= lo <= hi <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not FIRST-LAST with 1024 <= FIRST <= LAST <= 65535"
        )
    return lo, hi


async def _serve_server(settings: ServerSettings) -> None:
    from heteroflow.server import ServerApp
    from heteroflow.serving import bind, install_stop_signals, settle_heap

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


def _server(a: argparse.Namespace) -> int:
    from heteroflow.server import TlsFilesUnusable

    given = {"host": a.host, "port": a.port, "tls_cert_file": a.tls_cert, "tls_key_file": a.tls_key}
    overrides = {k: v for k, v in given.items() if v is not None}
    try:
        asyncio.run(_serve_server(ServerSettings(**overrides)))
    except TlsFilesUnusable as exc:  # issue 18: one line, not a traceback
        print(f"heteroflow server: {exc}", file=sys.stderr)
        return 2
    return 0


async def _run_agent(settings: AgentSettings) -> None:
    from heteroflow.agent.client import tls_context
    from heteroflow.agent.config import NodeConfig
    from heteroflow.agent.daemon import Agent
    from heteroflow.agent.factory import RuntimeUnavailable, make_launcher
    from heteroflow.core.clock import SystemClock
    from heteroflow.serving import install_stop_signals

    try:
        tls_context(settings.ca_file)  # issue 18: an unreadable CA bundle stops the start
    except ValueError as exc:
        raise SystemExit(f"heteroflow agent: {exc}") from exc
    config = NodeConfig.load(settings.config_file)
    name = settings.node_name or socket.gethostname()
    try:
        launcher = make_launcher(settings, config, name)
    except RuntimeUnavailable as exc:
        raise SystemExit(str(exc)) from exc
    agent = Agent(settings, config, launcher, SystemClock())
    stop = asyncio.Event()
    install_stop_signals(stop)
    print(
        f"HeteroFlow agent {agent.name} ({settings.runtime} runtime) -> {settings.server_url}",
        flush=True,
    )
    await agent.run(stop)


def _agent(a: argparse.Namespace) -> int:
    settings = AgentSettings(**({"runtime": a.runtime} if a.runtime else {}))
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(_run_agent(settings))
    return 0


async def _run_gateway(a: argparse.Namespace, token: str) -> int:
    from heteroflow.core.clock import SystemClock
    from heteroflow.gateway.app import GatewayApp
    from heteroflow.gateway.poller import SnapshotPoller
    from heteroflow.gateway.routes_file import RoutesFileError, RoutesFileWatcher
    from heteroflow.gateway.usage import (
        HttpUsageSink,
        JsonLinesUsageSink,
        UsageCollector,
        UsageSink,
    )
    from heteroflow.schemas.routing import SnapshotHolder
    from heteroflow.serving import bind, http_server, install_stop_signals, settle_heap

    settings = ServerSettings()
    holder = SnapshotHolder()
    sink: UsageSink | None
    if a.routes:
        # Standalone: routes from a file, no server; usage to a JSON-lines file or dropped.
        watcher = RoutesFileWatcher(
            Path(a.routes), holder, interval_s=settings.routes_reload_interval_s
        )
        try:
            watcher.load()
        except RoutesFileError as exc:
            print(exc, file=sys.stderr)
            return 2
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, watcher.request_reload)
        source = watcher.run
        sink = JsonLinesUsageSink(Path(a.usage_log)) if a.usage_log else None
    else:
        interval = settings.gateway_poll_interval_s
        source = SnapshotPoller(a.server, token, holder, interval_s=interval).run
        sink = HttpUsageSink(a.server, token)
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


def _gateway(a: argparse.Namespace) -> int:
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
        from heteroflow.logs import register_secrets

        register_secrets(token)  # issue 18 (P3): never in a log line
    return asyncio.run(_run_gateway(a, token))


def _hash_key(a: argparse.Namespace) -> int:
    from heteroflow.schemas.routing import hash_key

    if a.new:
        from heteroflow.core.ids import new_api_key

        key = new_api_key()
        print(f"key (shown once): {key}")
        print(f"sha256: {hash_key(key)}")
        return 0
    key = (a.key if a.key is not None else sys.stdin.readline()).strip()
    if not key:
        print("no key given (argument or one line on stdin)", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _migrate(a: argparse.Namespace) -> int:
    from heteroflow.db.engine import downgrade, make_engine, migrate

    settings = ServerSettings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url())
    try:
        if a.down_to:
            downgrade(engine, a.down_to)
            print(f"database schema is at revision {a.down_to}")
        else:
            migrate(engine)
            print("database is at the newest schema")
    finally:
        engine.dispose()
    return 0


def _server_database(settings: ServerSettings) -> Database | None:
    """The servers' database (HETEROFLOW_DATABASE_URL / HETEROFLOW_DATA_DIR), or None
    (said on stderr) when there is none yet: an empty SQLite file is not created."""
    from heteroflow.db.engine import Database

    if not settings.database_url and not settings.sqlite_path().exists():
        print(
            f"no database at {settings.sqlite_path()}: set HETEROFLOW_DATA_DIR or "
            "HETEROFLOW_DATABASE_URL as for the server",
            file=sys.stderr,
        )
        return None
    return Database.from_url(settings.resolved_database_url())


def _database_write_failed(exc: Exception) -> int:
    """One line naming the error's type: its message would carry the statement's
    parameters (a password hash, a secret)."""
    print(
        f"could not write the database ({type(exc).__name__}); is its schema up to "
        "date (heteroflow migrate)?",
        file=sys.stderr,
    )
    return 1


def _rotate_jwt_secret(_: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from heteroflow.services.auth import rotate_jwt_secret

    settings = ServerSettings()
    if settings.jwt_secret:
        print(
            "HETEROFLOW_JWT_SECRET is set: the servers take the JWT secret from the "
            "environment, not from the database, so it cannot be rotated here. Give every "
            "server instance a new HETEROFLOW_JWT_SECRET and restart them (or unset it to "
            "use the database's secret, which this command rotates).",
            file=sys.stderr,
        )
        return 2
    db = _server_database(settings)
    if db is None:
        return 1
    try:
        rotate_jwt_secret(db)
    except SQLAlchemyError as exc:
        return _database_write_failed(exc)
    finally:
        db.dispose()
    print(
        "JWT secret rotated: every token issued so far is now invalid (on every server "
        f"instance within {settings.jwt_secret_cache_s:g} s); everyone must log in again"
    )
    return 0


# --- issue 18: rotating the node token without downtime ---
def _rotate_node_token(a: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    settings = ServerSettings()
    if settings.node_token and not a.status:
        print(
            "HETEROFLOW_NODE_TOKEN is set: the servers take the node token from the "
            "environment, not from the database, so it is not rotated here. Rotate it in "
            "the environment: on every server set HETEROFLOW_NODE_TOKEN to the new value and "
            "HETEROFLOW_NODE_TOKEN_PREVIOUS to the old one and restart them one at a time, "
            "switch the agents, then unset HETEROFLOW_NODE_TOKEN_PREVIOUS and restart the "
            "servers again (or unset both to use the database's token, which this command "
            "rotates).",
            file=sys.stderr,
        )
        return 2
    if a.force and not a.finish:
        print("--force goes with --finish", file=sys.stderr)
        return 2
    db = _server_database(settings)
    if db is None:
        return 1
    try:
        return _node_token_action(a, db, settings)
    except SQLAlchemyError as exc:
        return _database_write_failed(exc)
    finally:
        db.dispose()


def _node_token_action(a: argparse.Namespace, db: Database, settings: ServerSettings) -> int:
    from heteroflow.core.clock import SystemClock
    from heteroflow.core.errors import Conflict
    from heteroflow.services.auth import (
        NODE_TOKEN_SEEN_WINDOW_S,
        finish_node_token_rotation,
        load_node_tokens,
        nodes_on_previous_token,
        rotate_node_token,
    )

    now = SystemClock().now()
    if a.show:
        print(load_node_tokens(db).current)
        return 0
    on_previous = nodes_on_previous_token(db, now)
    listing = [
        f"  {n.node_id}  {n.name or '(not registered)'}  seen {_utc(n.seen_at)}"
        for n in on_previous
    ]
    window = f"{NODE_TOKEN_SEEN_WINDOW_S:g} s"
    if a.status:
        state = load_node_tokens(db) if not settings.node_token else None
        if state is not None and state.previous and state.previous_until is not None:
            live = state.previous_live(now)
            print(
                f"rotation in progress: the previous node token works until "
                f"{_utc(state.previous_until)}"
                if live
                else f"the previous node token expired at {_utc(state.previous_until)}: "
                "end the rotation with --finish"
            )
        elif settings.node_token_previous:
            print("rotation in progress (HETEROFLOW_NODE_TOKEN_PREVIOUS is set)")
        else:
            print("no rotation in progress")
        print(f"nodes that used the previous node token in the last {window}: {len(on_previous)}")
        for line in listing:
            print(line)
        return 0
    if a.finish:
        if on_previous and not a.force:
            print(
                f"these nodes used the previous node token in the last {window}: give them "
                "the new one first (or --force):\n" + "\n".join(listing),
                file=sys.stderr,
            )
            return 1
        if finish_node_token_rotation(db):
            print(
                "node token rotation finished: only the current token works now (on every "
                f"server instance within {settings.node_token_cache_s:g} s)"
            )
        else:
            print("no rotation in progress")
        return 0
    try:
        state = rotate_node_token(db, SystemClock(), a.previous_valid_hours * 3600.0)
    except Conflict as exc:
        print(exc.message, file=sys.stderr)
        return 1
    print(f"new node token: {state.current}")
    if state.previous_until is not None:
        print(
            f"the previous node token works until {_utc(state.previous_until)}. Give every "
            "agent the new one (HETEROFLOW_AGENT_NODE_TOKEN) and restart it; "
            "`heteroflow rotate-node-token --status` lists the nodes still on the previous "
            "token; `heteroflow rotate-node-token --finish` ends the rotation."
        )
    else:
        print("the previous node token no longer works: agents need the new one now")
    return 0


def _hours(text: str) -> float:
    """A number of hours, 0 or more (``rotate-node-token --previous-valid-hours``)."""
    try:
        hours = float(text)
    except ValueError:
        hours = -1.0
    if not 0.0 <= hours <= 24.0 * 366:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours from 0 to 8784")
    return hours


def _utc(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _read_new_password(a: argparse.Namespace) -> str | None:
    if a.password_stdin or not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    password = getpass.getpass(f"new password for {a.username}: ")
    if getpass.getpass("the same again: ") != password:
        print("the two passwords differ", file=sys.stderr)
        return None
    return password


def _reset_password(a: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from heteroflow.core.clock import SystemClock
    from heteroflow.core.errors import NotFound, ValidationFailed
    from heteroflow.services.auth import reset_password

    password = _read_new_password(a)
    if not password:
        if password is not None:
            print("no password given (one line on stdin)", file=sys.stderr)
        return 2
    db = _server_database(ServerSettings())
    if db is None:
        return 1
    try:
        reset_password(db, SystemClock(), a.username, password)
    except NotFound:
        print(f"no user named {a.username!r}", file=sys.stderr)
        return 1
    except ValidationFailed as exc:
        print(exc.message, file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        return _database_write_failed(exc)
    finally:
        db.dispose()
    print(f"password of {a.username} reset: the tokens issued to them so far no longer work")
    return 0


def _login(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    password = a.password or os.environ.get("HETEROFLOW_PASSWORD") or getpass.getpass()
    remote.login(a.server, a.username, password)
    return 0


def _status(a: argparse.Namespace) -> int:
    from heteroflow.cmd import status

    return status.run(a.json)


def _services(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    if a.action == "create":
        task: dict[str, object] = {"image": a.image, "gpu_required": a.gpus}
        if a.model_path:
            task["model_path"] = a.model_path
        if a.engine:
            task["engine"] = a.engine
        if a.engine_arg:
            task["engine_args"] = a.engine_arg
        body: dict[str, object] = {"name": a.name, "task": task}
        if a.model_name:
            body["model_name"] = a.model_name
        if a.priority is not None:
            body["priority"] = a.priority
        remote.create_service(body, wait=a.wait, timeout_s=a.timeout, as_json=a.json)
    elif a.action == "list":
        remote.list_services(as_json=a.json)
    elif a.action == "show":
        remote.show_service(a.id, as_json=a.json)
    elif a.action == "delete":
        remote.delete_service(a.id, wait=a.wait, timeout_s=a.timeout)
    # issue 13: the service's desired state
    elif a.action == "stop":
        remote.stop_service(a.id, wait=a.wait, timeout_s=a.timeout)
    elif a.action == "start":
        remote.start_service(a.id, wait=a.wait, timeout_s=a.timeout)
    elif a.action == "restart":
        remote.restart_service(a.id, wait=a.wait, timeout_s=a.timeout)
    elif a.action == "update":  # issue 14 (J1, J2)
        update: dict[str, object] = {"strategy": a.strategy, "batch_size": a.batch_size}
        if a.image:
            update["image"] = a.image
        if a.engine_arg is not None:
            update["engine_args"] = a.engine_arg
        if a.env is not None:
            update["env"] = a.env
        remote.update_service(
            a.id, update, wait=a.wait, timeout_s=a.timeout, as_json=a.json
        )
    elif a.action == "sleep":
        remote.sleep_service(a.id, as_json=a.json)
    elif a.action == "wake":
        remote.wake_service(a.id, wait=a.wait, timeout_s=a.timeout, as_json=a.json)
    # issue 14 (I1, I2): scale and autoscale
    elif a.action == "scale":
        remote.scale_service(
            a.id, a.replicas, wait=a.wait, timeout_s=a.timeout, as_json=a.json
        )
    elif a.action == "autoscale":
        remote.autoscale_service(a.id, _autoscale_body(a), as_json=a.json)
    elif a.action == "window":  # issue 14 (K1)
        mode, changes = _window_changes(a)
        remote.window_service(a.id, changes, mode, as_json=a.json)
    return 0


def _window_changes(a: argparse.Namespace) -> tuple[str, dict[str, object]]:
    """issue 14 (K1): what `services window` does (show / set / disable / enable /
    remove) and, to set, the fields given (the others keep their stored values)."""
    changes: dict[str, object] = {
        key: value
        for key, value in (
            ("start", a.start), ("end", a.end), ("timezone", a.timezone), ("days", a.days),
            ("action", a.window_action), ("replicas", a.replicas),
        )
        if value is not None
    }
    modes = [m for m in ("disable", "enable", "remove") if getattr(a, m)]
    if modes and changes:
        raise CliError(f"--{modes[0]} takes no other option")
    if modes:
        return modes[0], {}
    return ("set" if changes else "show"), changes


def _days(text: str) -> list[str]:
    """issue 14 (K1): ``mon-fri,sun`` -> the API's list of days."""
    from heteroflow.core.windows import expand_days

    try:
        return expand_days(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _autoscale_body(a: argparse.Namespace) -> dict[str, object]:
    """issue 14 (I1): what `services autoscale` sends; a flag left out keeps its value."""
    body: dict[str, object] = {"enabled": not a.disable}
    for key, value in (
        ("metric", a.metric), ("target", a.target), ("min_replicas", a.min),
        ("max_replicas", a.max),
    ):
        if value is not None:
            body[key] = value
    return body


def _tasks(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    if a.action == "show":
        remote.show_task(a.id, as_json=a.json)
    elif a.action == "stop":
        remote.stop_task(a.id, wait=a.wait, timeout_s=a.timeout)
    elif a.action == "sleep":
        remote.sleep_task(a.id, as_json=a.json)
    elif a.action == "wake":
        remote.wake_task(a.id, wait=a.wait, timeout_s=a.timeout, as_json=a.json)
    return 0


def _nodes(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote, tables

    remote.get_list("/api/v1/nodes", tables.nodes_table, a.json, "nodes")
    return 0


def _users(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote, tables

    if a.action == "create":
        body = {"username": a.username, "password": a.password, "role": a.role}
        if a.tenant_id:
            body["tenant_id"] = a.tenant_id
        remote.post("/api/v1/users", body, tables.user_block, a.json)
    else:
        remote.get_list("/api/v1/users", tables.users_table, a.json, "users")
    return 0


def _tenants(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote, tables

    if a.action == "list":
        remote.get_list("/api/v1/tenants", tables.tenants_table, a.json, "tenants")
        return 0
    if a.action == "quota":
        remote.get(f"/api/v1/tenants/{a.id}/quota", tables.quota_block, a.json)
        return 0
    body: dict[str, object] = {"name": a.name} if a.action == "create" else {}
    if a.priority_ceiling is not None:
        body["priority_ceiling"] = a.priority_ceiling
    for name in ("quota_cards", "quota_services", "quota_replicas", "quota_cpu_memory_mb",
                 "quota_tokens", "quota_token_period", "members_see_own"):
        if getattr(a, name, None) is not None:
            body[name] = getattr(a, name)
    if a.sharing_group is not None:
        body["sharing_group_id"] = None if a.sharing_group == "none" else a.sharing_group
    if a.action == "create":
        remote.post("/api/v1/tenants", body, tables.tenant_block, a.json)
    else:
        remote.patch(f"/api/v1/tenants/{a.id}", body, tables.tenant_block, a.json)
    return 0


def _platform(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    path = "/api/v1/platform-settings"
    if a.action == "show":
        remote.get(path, as_json=a.json)
        return 0
    body = {
        name: value == "on"
        for name, value in (
            ("inference_dedup_enabled", a.inference_dedup),
            ("cross_tenant_dedup_enabled", a.cross_tenant_dedup),
        )
        if value is not None
    }
    if not body:
        raise CliError("nothing to set: give --inference-dedup and/or --cross-tenant-dedup")
    remote.put(path, body, as_json=a.json)
    return 0


def _sharing_groups(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote, tables

    base = "/api/v1/sharing-groups"
    block = tables.sharing_group_block
    if a.action == "list":
        remote.get_list(base, tables.sharing_groups_table, a.json, "sharing groups")
    elif a.action == "show":
        remote.get(f"{base}/{a.id}", block, a.json)
    elif a.action == "create":
        remote.post(base, {"name": a.name}, block, a.json)
    elif a.action == "delete":
        remote.delete(f"{base}/{a.id}", block, a.json)
    elif a.action == "add-tenant":
        remote.post(f"{base}/{a.id}/tenants", {"tenant_id": a.tenant_id}, block, a.json)
    elif a.action == "remove-tenant":
        remote.delete(f"{base}/{a.id}/tenants/{a.tenant_id}", block, a.json)
    return 0


def _logs(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    remote.logs(a.task_id, follow=a.follow)
    return 0


DESCRIPTION = """\
HeteroFlow runs LLM inference services on your GPU and CPU machines and serves them
behind one OpenAI-compatible endpoint. Start everything on one machine with `up`, or run
`server`, `agent` and `gateway` on many; manage it with the other commands after `login`."""

EPILOG = """\
examples:
  heteroflow up                                    everything on this machine, demo model
  heteroflow login --server http://gpu-host:3333   sign in (asks for the password)
  heteroflow status                                is anything wrong? (exit 1 if so)

`heteroflow COMMAND --help` describes a command. Management commands exit 0 when done,
1 when the server refused or a wait ended badly, 2 when the server cannot be reached or
you are not logged in."""

SERVICES_EPILOG = """\
example:
  heteroflow services create --name chat --model-path qwen2.5-0.5b.gguf --gpus 0"""


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="print the API's JSON answer unchanged (for scripts)"
    )


def _wait_flags(p: argparse.ArgumentParser, what: str, *, default: bool) -> None:
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"follow it until {what}, one line per change (default: "
        f"{'wait' if default else 'do not wait'}); exit 1 if it ends badly",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600,
        metavar="SECONDS",
        help="give up waiting after this long, exit 1 (default: 600)",
    )


def _management_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that talk to a server's management API (after `heteroflow login`)."""
    lg = sub.add_parser("login", help="sign in to a server's management API")
    lg.add_argument("--server", default="http://127.0.0.1:3333", help="the server's URL")
    lg.add_argument("--username", default="admin", help="default: admin")
    lg.add_argument("--password", default=None, help="default: $HETEROFLOW_PASSWORD or prompt")
    lg.set_defaults(fn=_login)

    st = sub.add_parser(
        "status",
        help="the platform on one screen: server, nodes, services, and what is wrong",
        description="Server, server instances, gateway, nodes and services, then what is "
        "wrong (failed services, pending tasks and why, offline nodes). Exit 0: nothing is "
        "wrong; 1: something is; 2: the server cannot be reached or you are not logged in.",
    )
    _json_flag(st)
    st.set_defaults(fn=_status)

    sv = sub.add_parser(
        "services",
        help="create, list, show, delete, stop/start, sleep/wake, scale, update services",
        epilog=SERVICES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    svs = sv.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = svs.add_parser("create", help="create a service and (by default) wait until it runs")
    c.add_argument("--name", required=True, help="the service's name (letters, digits, -)")
    c.add_argument(
        "--image",
        default="",
        help="engine image; default: the server picks one from the engines nodes report",
    )
    c.add_argument(
        "--model-path",
        default="",
        help="absolute path on the node, or a name under the node's models directory",
    )
    c.add_argument("--model-name", default=None, help="the model name clients ask for")
    c.add_argument("--gpus", type=int, default=1, help="GPUs per replica; 0 = CPU (default 1)")
    c.add_argument("--engine", default="", help="engine (e.g. llamacpp, vllm); default: chosen")
    c.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="one extra engine argument (repeat it; write --engine-arg=-c for dashes)",
    )
    c.add_argument(
        "--priority",
        type=int,
        default=None,
        help="0-1000, higher first (members: up to their tenant's priority ceiling)",
    )
    _wait_flags(c, "it runs", default=True)
    c.add_argument(
        "--json",
        action="store_true",
        help="print the API's answer unchanged; progress, if waiting, goes to stderr",
    )
    ls = svs.add_parser("list", help="every service you may see, as a table")
    _json_flag(ls)
    sh = svs.add_parser("show", help="one service: its fields, tasks and why they wait")
    sh.add_argument("id", help="the service id (tg-...)")
    _json_flag(sh)
    de = svs.add_parser("delete", help="delete a service: its tasks stop")
    de.add_argument("id", help="the service id (tg-...)")
    _wait_flags(de, "every task has stopped", default=False)
    # --- issue 13: stop / start / restart (the service's desired state) ---
    so = svs.add_parser(
        "stop", help="stop a service; it stays stopped (nothing restarts it) until started"
    )
    so.add_argument("id", help="the service id (tg-...)")
    _wait_flags(so, "every task has stopped", default=False)
    sa = svs.add_parser(
        "start", help="start a stopped or failed service again (same endpoint and API key)"
    )
    sa.add_argument("id", help="the service id (tg-...)")
    _wait_flags(sa, "it runs", default=False)
    sr = svs.add_parser("restart", help="stop a service, then start it with fresh tasks")
    sr.add_argument("id", help="the service id (tg-...)")
    _wait_flags(sr, "it runs", default=False)
    # --- end issue 13 ---
    # --- issue 14: a new generation (rolling update or recreate) ---
    su = svs.add_parser(
        "update",
        help="roll a service to a new image / engine arguments / environment",
        description="Start a new generation of every replica. rolling (default): batch "
        "by batch, each new replica runs and passes its health check before an old one "
        "drains and stops; a batch that fails is tried 3 more times, then the update "
        "rolls back. recreate: stop every replica, then start every new one.",
    )
    su.add_argument("id", help="the service id (tg-...)")
    su.add_argument("--image", default="", help="the new generation's engine image")
    su.add_argument(
        "--engine-arg",
        action="append",
        default=None,
        help="the new generation's engine arguments, one per flag (repeat it; "
        "--engine-arg=-c for dashes); they replace the current ones",
    )
    su.add_argument(
        "--env",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="the new generation's environment (repeat it); it replaces the current one",
    )
    su.add_argument(
        "--strategy",
        choices=("rolling", "recreate"),
        default="rolling",
        help="rolling (default): batch by batch, no downtime; recreate: stop all, start all",
    )
    su.add_argument(
        "--batch-size", type=int, default=1, help="rolling: replicas replaced at a time (1)"
    )
    _wait_flags(su, "the update is done", default=False)
    su.add_argument(
        "--json",
        action="store_true",
        help="print the API's answer unchanged; progress, if waiting, goes to stderr",
    )
    # --- end issue 14 ---
    sl = svs.add_parser(
        "sleep", help="put a service to sleep: engines stop, memory is freed, it stays listed"
    )
    sl.add_argument("id", help="the service id (tg-...)")
    _json_flag(sl)
    wk = svs.add_parser("wake", help="wake a sleeping service (says why when it must wait)")
    wk.add_argument("id", help="the service id (tg-...)")
    _wait_flags(wk, "it runs", default=False)
    _json_flag(wk)
    # --- issue 14 (I1, I2): scale and autoscale ---
    sc = svs.add_parser(
        "scale", help="set a service's replica count (within its min and max replicas)"
    )
    sc.add_argument("id", help="the service id (tg-...)")
    sc.add_argument("replicas", type=int, help="the replica count")
    _wait_flags(sc, "that many replicas run", default=False)
    _json_flag(sc)
    au = svs.add_parser(
        "autoscale",
        help="autoscale a service by a load metric, or --disable it; set min / max replicas",
    )
    au.add_argument("id", help="the service id (tg-...)")
    au.add_argument(
        "--metric",
        choices=["inflight", "tokens_per_s", "queue", "kv_cache"],
        default=None,
        help="inflight: requests in flight per replica; tokens_per_s: tokens answered per "
        "second per replica; queue: requests waiting in the engines per replica; "
        "kv_cache: KV-cache use in %% (default: as stored)",
    )
    au.add_argument(
        "--target", type=float, default=None, help="the metric per replica to aim for"
    )
    au.add_argument("--min", type=int, default=None, help="min replicas (default: as stored)")
    au.add_argument("--max", type=int, default=None, help="max replicas (default: as stored)")
    au.add_argument(
        "--disable", action="store_true", help="turn autoscaling off (the policy is kept)"
    )
    _json_flag(au)
    # --- end issue 14 ---
    # --- issue 14 (K1): the schedule window ---
    wn = svs.add_parser(
        "window",
        help="when a service runs: outside its window it is paused, scaled down or stopped",
        description="Show or set a service's schedule window. Outside the window the "
        "leader (every 60 s) pauses the service (its engines sleep; it wakes on a "
        "request), scales it down to --replicas, or stops it; back inside, a pause or "
        "scale is undone (a stop is not: start the service). Options left out keep their "
        "stored values. Without options: show the window.",
    )
    wn.add_argument("id", help="the service id (tg-...)")
    wn.add_argument("--start", default=None, metavar="HH:MM", help="local time it opens")
    wn.add_argument(
        "--end", default=None, metavar="HH:MM",
        help="local time it closes (24:00 = midnight; before --start = the next day)",
    )
    wn.add_argument(
        "--timezone", default=None, metavar="ZONE",
        help="IANA time zone, e.g. Europe/Berlin (default UTC)",
    )
    wn.add_argument(
        "--days", type=_days, default=None, metavar="DAYS",
        help="days it opens: mon-fri, sat,sun, every (default every day)",
    )
    wn.add_argument(
        "--action", dest="window_action", choices=("pause", "scale", "stop"), default=None,
        help="outside the window (default pause)",
    )
    wn.add_argument(
        "--replicas", type=int, default=None, help="scale: the replica count outside"
    )
    wm = wn.add_mutually_exclusive_group()
    wm.add_argument(
        "--disable", action="store_true",
        help="keep the window but stop acting on it (what it has in effect is undone)",
    )
    wm.add_argument("--enable", action="store_true", help="act on the stored window again")
    wm.add_argument("--remove", action="store_true", help="remove the window")
    _json_flag(wn)
    # --- end issue 14 (K1) ---
    sv.set_defaults(fn=_services)

    tk = sub.add_parser("tasks", help="one task of a service: show / stop / sleep / wake")
    tks = tk.add_subparsers(dest="action", required=True, metavar="ACTION")
    ts = tks.add_parser("show", help="one task's fields")
    ts.add_argument("id", help="the task id (task-...)")
    _json_flag(ts)
    tp = tks.add_parser("stop", help="stop one task")
    tp.add_argument("id", help="the task id (task-...)")
    _wait_flags(tp, "it has stopped", default=False)
    tsl = tks.add_parser("sleep", help="put a running inference task to sleep")
    tsl.add_argument("id", help="the task id (task-...)")
    _json_flag(tsl)
    twk = tks.add_parser("wake", help="wake a sleeping task (says why when it must wait)")
    twk.add_argument("id", help="the task id (task-...)")
    _wait_flags(twk, "it runs", default=False)
    _json_flag(twk)
    tk.set_defaults(fn=_tasks)

    tn = sub.add_parser("tenants", help="tenants (operators create them)")
    tns = tn.add_subparsers(dest="action", required=True, metavar="ACTION")
    _json_flag(tns.add_parser("list", help="the tenants you may see"))
    tc = tns.add_parser("create", help="operators: a new tenant")
    tc.add_argument("name", help="the tenant's name")
    tu = tns.add_parser("update", help="operators: priority ceiling, sharing group, quotas")
    tu.add_argument("id", help="the tenant id")
    for t in (tc, tu):
        t.add_argument("--priority-ceiling", type=int, default=None, help="0-1000 (default 100)")
        t.add_argument(
            "--sharing-group", default=None, metavar="ID", help="a sharing group id; none: no group"
        )
        _json_flag(t)
    for flag, text in (
        ("--quota-cards", "whole GPU cards by commitment (a card at 50%% counts 0.5)"),
        ("--quota-services", "live services"),
        ("--quota-replicas", "tasks of those services"),
        ("--quota-cpu-memory-mb", "MB booked by CPU work"),
    ):
        tu.add_argument(flag, type=int, default=None, metavar="N", help=f"{text}; 0: no limit")
    tu.add_argument(
        "--quota-tokens", type=int, default=None, metavar="N",
        help="gateway tokens per --quota-token-period, all keys together; 0: no limit",
    )
    tu.add_argument("--quota-token-period", choices=("day", "month"), default=None,
                    help="the UTC day or month of --quota-tokens")
    tu.add_argument(
        "--members-see-own", action=argparse.BooleanOptionalAction, default=None,
        help="members see and manage only the services and keys they created (N5)",
    )
    tq = tns.add_parser("quota", help="a tenant's quotas and what it holds (members: their own)")
    tq.add_argument("id", help="the tenant id")
    _json_flag(tq)
    tn.set_defaults(fn=_tenants)

    pf = sub.add_parser("platform", help="platform switches: inference dedup (operators only)")
    pfs = pf.add_subparsers(dest="action", required=True, metavar="ACTION")
    _json_flag(pfs.add_parser("show", help="the switches and their values"))
    pset = pfs.add_parser("set", help="turn switches on or off (the others keep their value)")
    pset.add_argument(
        "--inference-dedup", choices=["on", "off"], default=None,
        help="a create of a model already served (same model path and image) reuses it",
    )
    pset.add_argument(
        "--cross-tenant-dedup", choices=["on", "off"], default=None,
        help="dedup also reuses services of tenants in the caller's sharing group",
    )
    _json_flag(pset)
    pf.set_defaults(fn=_platform)

    sg = sub.add_parser("sharing-groups", help="tenants that may share GPU cards (operators only)")
    sgs = sg.add_subparsers(dest="action", required=True, metavar="ACTION")
    _json_flag(sgs.add_parser("list", help="every sharing group and its tenants"))
    sgc = sgs.add_parser("create", help="a new, empty sharing group")
    sgc.add_argument("name", help="the group's name")
    _json_flag(sgc)
    sgv = sgs.add_parser("show", help="one sharing group and its tenants")
    sgv.add_argument("id", help="the sharing group id")
    _json_flag(sgv)
    sgd = sgs.add_parser("delete", help="delete a sharing group (it must have no tenants)")
    sgd.add_argument("id", help="the sharing group id")
    _json_flag(sgd)
    for action, text in (("add-tenant", "put a tenant in"), ("remove-tenant", "take one out")):
        m = sgs.add_parser(action, help=f"{text} the group")
        m.add_argument("id", help="the sharing group id")
        m.add_argument("tenant_id", help="the tenant id")
        _json_flag(m)
    sg.set_defaults(fn=_sharing_groups)

    us = sub.add_parser("users", help="users (operators create them)")
    uss = us.add_subparsers(dest="action", required=True, metavar="ACTION")
    _json_flag(uss.add_parser("list", help="the users you may see"))
    uc = uss.add_parser("create", help="operators: a new user")
    uc.add_argument("username", help="the user's login name")
    uc.add_argument("--password", required=True, help="at least 8 characters")
    uc.add_argument(
        "--role", choices=["operator", "member"], default="member", help="default: member"
    )
    uc.add_argument("--tenant-id", default=None, help="default: your own tenant")
    _json_flag(uc)
    us.set_defaults(fn=_users)

    nd = sub.add_parser("nodes", help="list nodes: status, GPUs, load")
    _json_flag(nd)
    nd.set_defaults(fn=_nodes)

    lo = sub.add_parser("logs", help="print a task's output (-f: follow it live)")
    lo.add_argument("task_id", help="the task id (task-...)")
    lo.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    lo.set_defaults(fn=_logs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="heteroflow",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="all in one: server, scheduler, agent, gateway, demo model")
    up.add_argument(
        "--data-dir", default=str(default_data_dir()),
        help="database, logs, the demo's API key (default: %(default)s)",
    )
    up.add_argument("--models-dir", default=None, help="default: DATA_DIR/models")
    up.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    up.add_argument(
        "--port", type=int, default=3333, help="API and gateway port (default: %(default)s)"
    )
    up.add_argument(
        "--port-range", type=port_range, default=None, metavar="FIRST-LAST",
        help="host ports engines may get, e.g. 30000-30999 (default: 20000-29999); ports "
        "something else listens on are skipped",
    )
    up.add_argument(
        "--demo", choices=["auto", "gemma", "tiny", "none"], default="auto",
        help="the model served at start: auto = Gemma 3 270M if its package is installed, "
        "else a generated tiny model; none = no demo",
    )
    up.add_argument("--agent-config", default=None, help="node config JSON (declared cards)")
    up.add_argument("--threads", type=int, default=2, help="CPU threads per llama.cpp engine")
    up.add_argument(
        "--runtime",
        choices=["process", "docker"],
        default="process",
        help="how the local agent runs engines (default: process)",
    )
    up.set_defaults(fn=_up)

    srv = sub.add_parser("server", help="API + controllers + gateway (HETEROFLOW_* env)")
    srv.add_argument(
        "--host", default=None, help="listen address (default: $HETEROFLOW_HOST or 127.0.0.1)"
    )
    srv.add_argument(
        "--port", type=int, default=None, help="listen port (default: $HETEROFLOW_PORT or 3333)"
    )
    # issue 18: TLS on the server's own port (else put a TLS proxy in front of it)
    srv.add_argument(
        "--tls-cert", default=None, metavar="PEM",
        help="serve https with this certificate (chain) (default: $HETEROFLOW_TLS_CERT_FILE)",
    )
    srv.add_argument(
        "--tls-key", default=None, metavar="PEM",
        help="the certificate's private key (default: $HETEROFLOW_TLS_KEY_FILE)",
    )
    srv.set_defaults(fn=_server)

    ag = sub.add_parser("agent", help="node agent (HETEROFLOW_AGENT_* env)")
    ag.add_argument(
        "--runtime",
        choices=["docker", "process"],
        default=None,
        help="default: $HETEROFLOW_AGENT_RUNTIME or docker",
    )
    ag.set_defaults(fn=_agent)

    gw = sub.add_parser(
        "gateway", help="a separate gateway: a server's routes, or standalone from a file"
    )
    gw.add_argument("--server", default=None, help="poll this server's routing snapshot")
    gw.add_argument(
        "--token",
        default=None,
        help="the server's gateway token (default: $HETEROFLOW_GATEWAY_TOKEN)",
    )
    gw.add_argument(
        "--routes", default=None, help="standalone: routing file (JSON, or .toml); no server"
    )
    gw.add_argument(
        "--usage-log", default=None, help="standalone: append usage as JSON lines (else dropped)"
    )
    gw.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    gw.add_argument("--port", type=int, default=3333, help="listen port (default: 3333)")
    gw.set_defaults(fn=_gateway)

    hk = sub.add_parser("hash-key", help="print an API key's sha256 for a routing file")
    hk.add_argument("key", nargs="?", default=None, help="default: one line from stdin")
    hk.add_argument("--new", action="store_true", help="make a new key and print both")
    hk.set_defaults(fn=_hash_key)

    mg = sub.add_parser("migrate", help="bring the database schema up to date")
    mg.add_argument(
        "--down-to", metavar="REVISION", default=None,
        help="take the schema down to REVISION instead (e.g. 0013; before running an older "
        "release — stop the servers first)",
    )
    mg.set_defaults(fn=_migrate)

    rj = sub.add_parser(
        "rotate-jwt-secret",
        help="new JWT secret in the servers' database: every issued token stops working",
    )
    rj.set_defaults(fn=_rotate_jwt_secret)

    # --- issue 18 ---
    rn = sub.add_parser(
        "rotate-node-token",
        help="new node token in the servers' database; the previous one works for a while",
        description="Rotate the node token agents present, without downtime: the new token "
        "works at once, the previous one until --previous-valid-hours pass or --finish. "
        "Run it where the servers' settings are (HETEROFLOW_DATABASE_URL).",
    )
    rn_mode = rn.add_mutually_exclusive_group()
    rn_mode.add_argument(
        "--status", action="store_true",
        help="whether a rotation is in progress, and the nodes still on the previous token",
    )
    rn_mode.add_argument(
        "--finish", action="store_true",
        help="end the rotation: only the current token works (refused while a node still "
        "uses the previous one, unless --force)",
    )
    rn_mode.add_argument(
        "--show", action="store_true", help="print the current node token (for a new agent)"
    )
    rn.add_argument(
        "--previous-valid-hours", type=_hours, default=24.0, metavar="HOURS",
        help="how long the previous token keeps working (default: %(default)g; 0: not at all)",
    )
    rn.add_argument("--force", action="store_true", help="--finish even if nodes still use it")
    rn.set_defaults(fn=_rotate_node_token)

    rp = sub.add_parser(
        "reset-password",
        help="set a user's password in the servers' database; their old tokens stop working",
    )
    rp.add_argument("username", help="whose password")
    rp.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the new password from stdin (default when stdin is not a terminal; "
        "else it is prompted for)",
    )
    rp.set_defaults(fn=_reset_password)

    _management_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _logging(args.verbose)
    # everything a HeteroFlow process writes (database, logs, tokens) is owner-only
    os.umask(PRIVATE_UMASK)
    try:
        return int(args.fn(args))
    except PortBusy as exc:  # one clear line, not a traceback (issue 12)
        print(f"heteroflow {args.cmd}: {exc.strerror}", file=sys.stderr)
        return 2
    except CliError as exc:  # a management command failed: one line on stderr, its code
        print(f"heteroflow {args.cmd}: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
