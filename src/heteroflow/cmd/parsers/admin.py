"""Operator commands run where the servers' settings are: ``hash-key``, ``migrate``,
``rotate-jwt-secret``, ``rotate-node-token``, ``reset-password``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers

ROOT = "heteroflow.cmd.admin"


def add_parsers(sub: Subparsers) -> None:
    hk = sub.add_parser("hash-key", help="print an API key's sha256 for a routing file")
    hk.add_argument("key", nargs="?", default=None, help="default: one line from stdin")
    hk.add_argument("--new", action="store_true", help="make a new key and print both")
    hk.set_defaults(root=ROOT)

    mg = sub.add_parser("migrate", help="bring the database schema up to date")
    mg.add_argument(
        "--down-to", metavar="REVISION", default=None,
        help="take the schema down to REVISION instead (e.g. 0013; before running an older "
        "release — stop the servers first)",
    )
    mg.set_defaults(root=ROOT)

    rj = sub.add_parser(
        "rotate-jwt-secret",
        help="new JWT secret in the servers' database: every issued token stops working",
    )
    rj.set_defaults(root=ROOT)
    _rotate_node_token(sub)

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
    rp.set_defaults(root=ROOT)


def hours(text: str) -> float:
    """A number of hours, 0 or more (``rotate-node-token --previous-valid-hours``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 24.0 * 366:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours from 0 to 8784")
    return value


def _rotate_node_token(sub: Subparsers) -> None:
    """issue 18: rotating the node token without downtime."""
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
        "--previous-valid-hours", type=hours, default=24.0, metavar="HOURS",
        help="how long the previous token keeps working (default: %(default)g; 0: not at all)",
    )
    rn.add_argument("--force", action="store_true", help="--finish even if nodes still use it")
    rn.set_defaults(root=ROOT)
