"""Operator commands run where the servers' settings are (HETEROFLOW_DATABASE_URL /
HETEROFLOW_DATA_DIR), straight on the database: ``migrate``, ``rotate-jwt-secret``,
``rotate-node-token``, ``reset-password``; and ``hash-key`` for a routing file.

Each prints one line on stderr and exits 1 or 2 when it cannot do its work; a database
error is named by its type only (its message would carry a password hash or a secret).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from alembic.util.exc import CommandError
from sqlalchemy.exc import SQLAlchemyError

from heteroflow.core import clock
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.core.ids import new_api_key
from heteroflow.db.engine import Database, downgrade, make_engine, migrate
from heteroflow.schemas.routing import hash_key
from heteroflow.services.agents import node_tokens
from heteroflow.services.identity import auth, login
from heteroflow.settings import ServerSettings


def run(a: argparse.Namespace) -> int:
    return COMMANDS[a.cmd](a)


def _hash_key(a: argparse.Namespace) -> int:
    if a.new:
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
    settings = ServerSettings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url())
    try:
        if a.down_to:
            try:
                downgrade(engine, a.down_to)
            except CommandError as exc:  # issue 33: "Can't locate revision ...", one line
                print(f"heteroflow migrate: --down-to {a.down_to}: {exc}", file=sys.stderr)
                return 2
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
        auth.rotate_jwt_secret(db)
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
    now = clock.SystemClock().now()
    if a.show:
        print(node_tokens.load_node_tokens(db).current)
        return 0
    on_previous = node_tokens.nodes_on_previous_token(db, now)
    listing = [
        f"  {n.node_id}  {n.name or '(not registered)'}  seen {_utc(n.seen_at)}"
        for n in on_previous
    ]
    if a.status:
        return _node_token_status(db, settings, now, listing)
    if a.finish:
        return _finish_node_token_rotation(a, db, settings, listing)
    try:
        state = node_tokens.rotate_node_token(
            db, clock.SystemClock(), a.previous_valid_hours * 3600.0
        )
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


def _node_token_status(
    db: Database, settings: ServerSettings, now: datetime, listing: list[str]
) -> int:
    state = node_tokens.load_node_tokens(db) if not settings.node_token else None
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
    print(f"nodes that used the previous node token in the last {_WINDOW}: {len(listing)}")
    for line in listing:
        print(line)
    return 0


def _finish_node_token_rotation(
    a: argparse.Namespace, db: Database, settings: ServerSettings, listing: list[str]
) -> int:
    if listing and not a.force:
        print(
            f"these nodes used the previous node token in the last {_WINDOW}: give them "
            "the new one first (or --force):\n" + "\n".join(listing),
            file=sys.stderr,
        )
        return 1
    if node_tokens.finish_node_token_rotation(db):
        print(
            "node token rotation finished: only the current token works now (on every "
            f"server instance within {settings.node_token_cache_s:g} s)"
        )
    else:
        print("no rotation in progress")
    return 0


_WINDOW = f"{node_tokens.NODE_TOKEN_SEEN_WINDOW_S:g} s"


def _utc(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _read_new_password(a: argparse.Namespace) -> str | None:
    if a.password_stdin or not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    try:
        password = getpass.getpass(f"new password for {a.username}: ")
        again = getpass.getpass("the same again: ")
    except EOFError:  # Ctrl-D at the prompt: no password, one line (issue 33)
        return ""
    if again != password:
        print("the two passwords differ", file=sys.stderr)
        return None
    return password


def _reset_password(a: argparse.Namespace) -> int:
    password = _read_new_password(a)
    if not password:
        if password is not None:
            print("no password given (one line on stdin)", file=sys.stderr)
        return 2
    db = _server_database(ServerSettings())
    if db is None:
        return 1
    try:
        login.reset_password(db, clock.SystemClock(), a.username, password)
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


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "hash-key": _hash_key,
    "migrate": _migrate,
    "rotate-jwt-secret": _rotate_jwt_secret,
    "rotate-node-token": _rotate_node_token,
    "reset-password": _reset_password,
}
