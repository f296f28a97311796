"""``heteroflow up``'s CLI side: the local CLI logged in to the server it started, and
the lines that say how to manage it (split from ``cmd/up.py``, which re-exports them)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from sqlalchemy import select

from heteroflow.cmd import remote
from heteroflow.core.errors import Unauthorized
from heteroflow.db.tables import User
from heteroflow.server import ServerApp
from heteroflow.services.identity.auth import Principal, authenticate
from heteroflow.settings import default_data_dir

# The CLI token `up` writes: long-lived (a demo machine is left running for days), yet
# revoked like any other by `rotate-jwt-secret` or a reset of the admin's password.
CLI_TOKEN_TTL_S = 30 * 24 * 3600.0


# ---- the CLI: logged in already, and how to log in ----


def cli_command() -> str:
    """How this user runs the CLI: ``heteroflow`` when that is on PATH, else its path."""
    here = Path(sys.executable).parent / "heteroflow"
    found = shutil.which("heteroflow")
    if found and (not here.exists() or Path(found).resolve() == here.resolve()):
        return "heteroflow"
    if here.exists():
        try:
            return f"./{here.relative_to(Path.cwd())}"
        except ValueError:
            return str(here)
    return f"{sys.executable} -m heteroflow.cli"


def cli_state_path() -> Path:
    """Where ``heteroflow login`` keeps its state (as ``remote.save_login`` does)."""
    return Path(os.environ.get("HETEROFLOW_CLI_DIR", str(default_data_dir()))) / remote.CLI_FILE


def _read_state(path: Path) -> dict[str, str]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict):
        return {}
    return {k: v for k, v in state.items() if isinstance(v, str)}


def login_cli(app: ServerApp, base: str, cli: str) -> str:
    """Log the CLI in to this server as admin; returns the line that says what was done.

    The CLI's state file is written when it is missing, when its login is to this
    server (a login this server's token check accepts, perhaps at the address of an
    earlier ``up`` on another port) or when it holds a dead login to this address. A
    live login is kept as it is (whoever it is for); a login to another server is left
    alone and a hint is returned instead.
    """
    path = cli_state_path()
    state = _read_state(path)
    server, token = state.get("server", "").rstrip("/"), state.get("token", "")
    with app.db.session() as s:
        who: Principal | None = None
        if token:
            try:
                who = authenticate(s, app.ctx.tokens, token)
            except Unauthorized:
                who = None
        if who is None and server and server != base:
            return (
                f"CLI: {path} is logged in to another server ({server}); for this one: "
                f"{cli} login --server {base}"
            )
        if who is None:
            admin = s.scalar(select(User).where(User.username == "admin"))
            assert admin is not None
            token = app.ctx.tokens.issue(admin, ttl_s=CLI_TOKEN_TTL_S)
            who = Principal(admin.id, admin.username, admin.tenant_id, admin.role)
    if server != base or state.get("token") != token:
        remote.save_login(base, token)
    return f"CLI: logged in as {who.username} ({path}); try: {cli} services list"


def management_hints(
    base: str, data_dir: Path, cli: str, cli_line: str, password_shown: bool
) -> str:
    env = (
        ""
        if data_dir == default_data_dir() and "HETEROFLOW_DATA_DIR" not in os.environ
        else (f"HETEROFLOW_DATA_DIR={data_dir} ")
    )
    reset = f"{env}{cli} reset-password admin"
    password = (
        "printed above, shown this once (change it: " + reset + ")"
        if password_shown
        else f"the one from the first start; set a new one with: {reset}"
    )
    return "\n".join(
        (
            f"Web console: {base}/ (log in as admin)",
            f"Management API on {base}/api/v1 (docs: {base}/api/v1/docs)",
            f"  admin user: admin; password: {password}",
            f"  {cli_line}",
            f"  log in from elsewhere: {cli} login --server {base} --username admin",
        )
    )
