"""The CLI's parser class and the argument types and flags many commands share
(``--port``, ``--json``, ``--wait``/``--timeout``)."""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # not subscriptable at run time
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

# the root of the commands that talk to a server's management API (after `login`)
MANAGE = "heteroflow.cmd.manage"

_REQUIRED = "the following arguments are required"


class _MissingRequired(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """``argparse`` that names a mistyped flag before a missing required one (issue 33).

    argparse checks the required arguments before it reports the unknown ones, so
    ``services create --nmae x`` said ``--name`` is required. Here a missing required
    argument is looked at again without the requirement: when something on the command
    line is not known, that is the error (with the nearest known flag); else the missing
    one is. An unknown argument is reported by the command's own parser, with the
    nearest flag. Sub-commands get this class too (``add_subparsers`` uses the parent's).
    """

    _probing = False

    def error(self, message: str) -> Any:  # argparse's own signature says NoReturn
        if message.startswith(_REQUIRED) and not self._probing:
            raise _MissingRequired(message)
        super().error(message)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        before = copy.copy(namespace)
        try:
            parsed, extras = super().parse_known_args(argv, namespace)
        except _MissingRequired as missing:
            unknown = self._unknown_without_requirements(argv, before)
            if unknown:
                super().error(
                    f"unrecognized arguments: {' '.join(unknown)}{self._nearest(unknown)}"
                )
            super().error(str(missing))
        if extras and not self._probing and self._subparsers is None:
            # a command's own parser names it (`heteroflow login: ...`), not the top one
            super().error(f"unrecognized arguments: {' '.join(extras)}{self._nearest(extras)}")
        return parsed, extras

    def _unknown_without_requirements(
        self, argv: list[str], namespace: argparse.Namespace | None
    ) -> list[str]:
        required = [a for a in self._actions if a.required]
        self._probing = True
        try:
            for a in required:
                a.required = False
            _, extras = super().parse_known_args(argv, namespace)
        except (_MissingRequired, SystemExit):
            return []
        finally:
            for a in required:
                a.required = True
            self._probing = False
        return extras

    def _nearest(self, unknown: list[str]) -> str:
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        for word in unknown:
            if word.startswith("--"):
                near = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
                if near:
                    return f" (did you mean {near[0]}?)"
        return ""


def seconds(text: str) -> float:
    """A wait's length in seconds: more than 0, at most 30 days (``--timeout``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 30 * 86400.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def port(text: str) -> int:
    """A TCP port, 1-65535, or 0: any free port (the OS picks; the process says which)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port from 1 to 65535 (0: any free)")
    return value


def count(minimum: int, maximum: int = 1_000_000) -> Any:
    """An integer type from ``minimum`` to ``maximum`` (a count argparse checks at the door)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number from {minimum} to {maximum}"
            )
        return value

    parse.__name__ = "count"  # argparse names the type in its message when it fails
    return parse


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
        type=seconds,
        default=600,
        metavar="SECONDS",
        help="give up waiting after this long, exit 1 (default: 600)",
    )
