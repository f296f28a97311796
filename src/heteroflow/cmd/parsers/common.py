"""Flags many management commands share (``--json``, ``--wait``/``--timeout``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # not subscriptable at run time
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

# the root of the commands that talk to a server's management API (after `login`)
MANAGE = "heteroflow.cmd.manage"


def json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="print the API's JSON answer unchanged (for scripts)"
    )


def json_progress_flag(p: argparse.ArgumentParser) -> None:
    """``--json`` of a command that may wait: the answer on stdout, progress on stderr."""
    p.add_argument(
        "--json",
        action="store_true",
        help="print the API's answer unchanged; progress, if waiting, goes to stderr",
    )


def wait_flags(p: argparse.ArgumentParser, what: str, *, default: bool) -> None:
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
