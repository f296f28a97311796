"""The process roots: ``up`` (all in one), ``server``, ``agent``, ``gateway``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import count, port
from heteroflow.settings import default_data_dir

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers


def add_parsers(sub: Subparsers) -> None:
    _up(sub)
    _server(sub)
    _agent(sub)
    _gateway(sub)


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


def _up(sub: Subparsers) -> None:
    up = sub.add_parser("up", help="all in one: server, scheduler, agent, gateway, demo model")
    up.add_argument(
        "--data-dir", default=str(default_data_dir()),
        help="database, logs, the demo's API key (default: %(default)s)",
    )
    up.add_argument(
        "--models-dir", default=None,
        help="an existing folder of models (default: DATA_DIR/models, made when missing)",
    )
    up.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    up.add_argument(
        "--port", type=port, default=3333, help="API and gateway port (default: %(default)s)"
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
    up.add_argument(
        "--threads", type=count(1, 1024), default=2, help="CPU threads per llama.cpp engine"
    )
    up.add_argument(
        "--runtime",
        choices=["process", "docker"],
        default="process",
        help="how the local agent runs engines (default: process)",
    )
    up.set_defaults(root="heteroflow.cmd.up")


def _server(sub: Subparsers) -> None:
    srv = sub.add_parser("server", help="API + controllers + gateway (HETEROFLOW_* env)")
    srv.add_argument(
        "--host", default=None, help="listen address (default: $HETEROFLOW_HOST or 127.0.0.1)"
    )
    srv.add_argument(
        "--port", type=port, default=None,
        help="listen port (default: $HETEROFLOW_PORT or 3333)",
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
    # issue 31: N server processes on one port (docs/operations.md)
    srv.add_argument(
        "--workers",
        type=count(1, 256),
        default=1,
        help="server processes sharing the port, each a whole instance (default: 1; "
        "more need PostgreSQL and $HETEROFLOW_REDIS_URL)",
    )
    srv.set_defaults(root="heteroflow.cmd.server")


def _agent(sub: Subparsers) -> None:
    ag = sub.add_parser("agent", help="node agent (HETEROFLOW_AGENT_* env)")
    ag.add_argument(
        "--runtime",
        choices=["docker", "process"],
        default=None,
        help="default: $HETEROFLOW_AGENT_RUNTIME or docker",
    )
    ag.set_defaults(root="heteroflow.cmd.agent")


def _gateway(sub: Subparsers) -> None:
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
    gw.add_argument("--port", type=port, default=3333, help="listen port (default: 3333)")
    gw.add_argument(
        "--workers",
        type=count(1, 256),
        default=None,
        help="processes sharing the port (default: the cores it may use with "
        "$HETEROFLOW_REDIS_URL, else 1: limits are exact across workers through Redis)",
    )
    gw.set_defaults(root="heteroflow.cmd.gateway")
