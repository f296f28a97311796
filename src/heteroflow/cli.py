"""The ``heteroflow`` command: parse the arguments, then hand them to one process root.

Entry points: up | server | agent | gateway (``cmd/up.py``, ``cmd/server.py``,
``cmd/agent.py``, ``cmd/gateway.py``), the operator commands on the database
(``cmd/admin.py``) and the management client (``cmd/manage.py``). The parsers live in
``cmd/parsers/``, one module per noun; each sub-command names its root, and ``main``
imports that root only when the sub-command runs — so ``heteroflow agent`` and
``heteroflow gateway`` never load the server's code (`.importlinter`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING

from heteroflow.cmd.errors import CliError
from heteroflow.cmd.parsers import NOUNS
from heteroflow.cmd.parsers.common import Parser
from heteroflow.private_files import PRIVATE_UMASK
from heteroflow.serving import PortBusy

if TYPE_CHECKING:
    from pydantic import ValidationError

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


def _logging(verbose: bool) -> None:
    from pydantic import ValidationError

    from heteroflow.logs import configure
    from heteroflow.settings import LogSettings

    try:  # issue 18 (P3): text (as before) or JSON lines; secrets redacted in both
        fmt = LogSettings().log_format
    except ValidationError:
        print("HETEROFLOW_LOG_FORMAT must be text or json", file=sys.stderr)
        raise SystemExit(2) from None
    configure(logging.DEBUG if verbose else logging.INFO, fmt)
    for noisy in ("httpx", "alembic", "gguf"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


class _Version(argparse.Action):
    """What an install (pip, an offline wheelhouse) put here, from the distribution's own
    record — looked up only when asked: the lookup would cost every command's start."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import version

        print(f"heteroflow {version('heteroflow')}")  # stdout, as argparse's own version does
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="heteroflow",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action=_Version, help="the installed version, and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for noun in NOUNS:
        noun.add_parsers(sub)
    return p


def settings_problem(exc: ValidationError) -> str | None:
    """One line for a setting that does not parse (``HETEROFLOW_PORT=abc``), naming the
    environment variable; None when the error is not a settings class's (a bug: let its
    traceback show)."""
    settings = getattr(import_module("heteroflow.settings"), exc.title, None)
    if not exc.title.endswith("Settings") or settings is None or not exc.errors():
        return None
    first = exc.errors()[0]
    name = ".".join(str(part) for part in first["loc"])
    prefix = str(settings.model_config.get("env_prefix") or "")
    got = f" (got {first['input']!r})" if isinstance(first.get("input"), str | int) else ""
    return f"setting {prefix}{name.upper()} (or its flag): {first['msg']}{got}"


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    _logging(args.verbose)
    # everything a HeteroFlow process writes (database, logs, tokens) is owner-only
    os.umask(PRIVATE_UMASK)
    try:
        return int(import_module(args.root).run(args))
    except ValidationError as exc:  # issue 33: a bad HETEROFLOW_* value is one line too
        line = settings_problem(exc)
        if line is None:
            raise
        print(f"heteroflow {args.cmd}: {line}", file=sys.stderr)
        return 2
    except PortBusy as exc:  # one clear line, not a traceback (issue 12)
        print(f"heteroflow {args.cmd}: {exc.strerror}", file=sys.stderr)
        return 2
    except CliError as exc:  # a management command failed: one line on stderr, its code
        print(f"heteroflow {args.cmd}: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
