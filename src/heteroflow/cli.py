"""Entry points: up | server | agent | gateway | migrate | login | services | ...

The `heteroflow` command; each sub-command delegates to `cmd/` or the process roots.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import socket
import sys
from pathlib import Path

from heteroflow.settings import AgentSettings, ServerSettings, default_data_dir


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
    )
    return asyncio.run(run_up(opts))


async def _serve_server(settings: ServerSettings) -> None:
    from heteroflow.server import ServerApp, bind, install_stop_signals

    app = ServerApp(settings)
    if app.bootstrap.admin_password_generated:
        print(f"admin password (shown once): {app.bootstrap.admin_password_generated}")
    if not settings.node_token:
        print("node token: set HETEROFLOW_NODE_TOKEN to choose it; agents need the same value")
    sock = bind(settings.host, settings.port)
    print(
        f"HeteroFlow server listening on http://{settings.host}:{sock.getsockname()[1]}", flush=True
    )
    stop = asyncio.Event()
    install_stop_signals(stop)
    await app.serve(stop, sock)


def _server(a: argparse.Namespace) -> int:
    overrides = {k: v for k, v in {"host": a.host, "port": a.port}.items() if v is not None}
    asyncio.run(_serve_server(ServerSettings(**overrides)))
    return 0


async def _run_agent(settings: AgentSettings) -> None:
    from heteroflow.agent.config import NodeConfig
    from heteroflow.agent.daemon import Agent
    from heteroflow.agent.factory import RuntimeUnavailable, make_launcher
    from heteroflow.core.clock import SystemClock
    from heteroflow.server import install_stop_signals

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


async def _run_gateway(server_url: str, token: str, host: str, port: int) -> None:
    from heteroflow.gateway.app import GatewayApp
    from heteroflow.gateway.poller import SnapshotPoller
    from heteroflow.gateway.snapshot import SnapshotHolder
    from heteroflow.server import bind, http_server, install_stop_signals

    holder = SnapshotHolder()
    app = GatewayApp(holder)
    sock = bind(host, port)
    stop = asyncio.Event()
    install_stop_signals(stop)
    server = http_server(app, lifespan="off")
    interval = ServerSettings().gateway_poll_interval_s
    poller = asyncio.create_task(
        SnapshotPoller(server_url, token, holder, interval_s=interval).run(stop)
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    print(f"HeteroFlow gateway listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    await stop.wait()
    server.should_exit = True
    await asyncio.gather(serving, poller, return_exceptions=True)
    await app.aclose()


def _gateway(a: argparse.Namespace) -> int:
    token = a.token or os.environ.get("HETEROFLOW_GATEWAY_TOKEN", "")
    if not token:
        print("a gateway token is needed: --token or HETEROFLOW_GATEWAY_TOKEN", file=sys.stderr)
        return 2
    asyncio.run(_run_gateway(a.server, token, a.host, a.port))
    return 0


def _migrate(_: argparse.Namespace) -> int:
    from heteroflow.db.engine import make_engine, migrate

    settings = ServerSettings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate(make_engine(settings.resolved_database_url()))
    print("database is at the newest schema")
    return 0


def _login(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    password = a.password or os.environ.get("HETEROFLOW_PASSWORD") or getpass.getpass()
    remote.login(a.server, a.username, password)
    return 0


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
        remote.create_service(body, wait=not a.no_wait)
    elif a.action == "list":
        remote.list_services()
    elif a.action == "show":
        remote.show_service(a.id)
    elif a.action == "delete":
        remote.delete_service(a.id)
    return 0


def _simple(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    path = {"tenants": "/api/v1/tenants", "users": "/api/v1/users", "nodes": "/api/v1/nodes"}
    if getattr(a, "action", "list") == "create":
        if a.cmd == "tenants":
            remote.post(path["tenants"], {"name": a.name})
        else:
            body = {"username": a.username, "password": a.password, "role": a.role}
            if a.tenant_id:
                body["tenant_id"] = a.tenant_id
            remote.post(path["users"], body)
    else:
        remote.get(path[a.cmd])
    return 0


def _logs(a: argparse.Namespace) -> int:
    from heteroflow.cmd import remote

    remote.logs(a.task_id, follow=a.follow)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heteroflow", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="all in one: server, scheduler, agent, gateway, demo model")
    up.add_argument("--data-dir", default=str(default_data_dir()))
    up.add_argument("--models-dir", default=None, help="default: DATA_DIR/models")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=3333)
    up.add_argument("--demo", choices=["auto", "gemma", "tiny", "none"], default="auto")
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
    srv.add_argument("--host", default=None)
    srv.add_argument("--port", type=int, default=None)
    srv.set_defaults(fn=_server)

    ag = sub.add_parser("agent", help="node agent (HETEROFLOW_AGENT_* env)")
    ag.add_argument(
        "--runtime",
        choices=["docker", "process"],
        default=None,
        help="default: $HETEROFLOW_AGENT_RUNTIME or docker",
    )
    ag.set_defaults(fn=_agent)

    gw = sub.add_parser("gateway", help="a separate gateway polling a server's snapshot")
    gw.add_argument("--server", required=True)
    gw.add_argument("--token", default=None)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=3333)
    gw.set_defaults(fn=_gateway)

    sub.add_parser("migrate", help="bring the database schema up to date").set_defaults(fn=_migrate)

    lg = sub.add_parser("login", help="sign in to a server's management API")
    lg.add_argument("--server", default="http://127.0.0.1:3333")
    lg.add_argument("--username", default="admin")
    lg.add_argument("--password", default=None, help="default: $HETEROFLOW_PASSWORD or prompt")
    lg.set_defaults(fn=_login)

    sv = sub.add_parser("services", help="create / list / show / delete services")
    svs = sv.add_subparsers(dest="action", required=True)
    c = svs.add_parser("create")
    c.add_argument("--name", required=True)
    c.add_argument("--image", required=True)
    c.add_argument("--model-path", default="")
    c.add_argument("--model-name", default=None)
    c.add_argument("--gpus", type=int, default=1)
    c.add_argument("--engine", default="")
    c.add_argument("--engine-arg", action="append", default=[])
    c.add_argument("--no-wait", action="store_true")
    svs.add_parser("list")
    for action in ("show", "delete"):
        svs.add_parser(action).add_argument("id")
    sv.set_defaults(fn=_services)

    tn = sub.add_parser("tenants", help="tenants (operators create them)")
    tns = tn.add_subparsers(dest="action", required=True)
    tns.add_parser("list")
    tns.add_parser("create").add_argument("name")
    tn.set_defaults(fn=_simple)

    us = sub.add_parser("users", help="users (operators create them)")
    uss = us.add_subparsers(dest="action", required=True)
    uss.add_parser("list")
    uc = uss.add_parser("create")
    uc.add_argument("username")
    uc.add_argument("--password", required=True)
    uc.add_argument("--role", choices=["operator", "member"], default="member")
    uc.add_argument("--tenant-id", default=None)
    us.set_defaults(fn=_simple)

    sub.add_parser("nodes", help="list nodes").set_defaults(fn=_simple)

    lo = sub.add_parser("logs", help="print a task's output (-f: follow it live)")
    lo.add_argument("task_id")
    lo.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    lo.set_defaults(fn=_logs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _logging(args.verbose)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
