"""Signing in to a server (``login``) and the platform on one screen (``status``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import MANAGE, json_flag

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers


def add_parsers(sub: Subparsers) -> None:
    lg = sub.add_parser("login", help="sign in to a server's management API")
    lg.add_argument("--server", default="http://127.0.0.1:3333", help="the server's URL")
    lg.add_argument("--username", default="admin", help="default: admin")
    lg.add_argument(
        "--password", default=None,
        help="default: $HETEROFLOW_PASSWORD, else one line on stdin when it is not a "
        "terminal, else a prompt",
    )
    lg.add_argument(
        "--password-stdin", action="store_true",
        help="read the password from one line on stdin (e.g. from a secrets file)",
    )
    lg.set_defaults(root=MANAGE)

    st = sub.add_parser(
        "status",
        help="the platform on one screen: server, nodes, services, and what is wrong",
        description="Server, server instances, gateway, nodes and services, then what is "
        "wrong (failed services, pending tasks and why, offline nodes). Exit 0: nothing is "
        "wrong; 1: something is; 2: the server cannot be reached or you are not logged in.",
    )
    json_flag(st)
    st.set_defaults(root=MANAGE)
