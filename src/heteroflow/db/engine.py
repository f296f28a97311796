"""Database engines: SQLite (WAL, the embedded default) or PostgreSQL by URL."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DisconnectionError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from heteroflow.private_files import private_file

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# JSON columns (node inventories, task ports and cards) go through orjson: the scheduler
# reads every node's cards each round, so (de)serialisation is on its hot path.
_JSON = {"json_serializer": _json_dumps, "json_deserializer": orjson.loads}


def driver_url(url: str) -> str:
    """``url`` with the driver SQLAlchemy is to use (psycopg 3 for postgresql://)."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            # owner-only before SQLite opens it: its -wal and -shm files take its mode
            private_file(Path(path))
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **_JSON
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    engine = create_engine(driver_url(url), pool_size=10, max_overflow=10, **_JSON)
    _ping_when_idle(engine, PING_IDLE_S)
    return engine


# A pooled connection idle longer than this is pinged before use (pool_pre_ping pings
# every checkout: one round trip more for each unit of work — a fifth of a heartbeat's).
PING_IDLE_S = 2.0


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Pessimistic disconnect handling for connections that sat in the pool.

    One that waited ``idle_s`` or more is pinged (the dialect's own ping, as
    ``pool_pre_ping`` does) and replaced when the ping fails, so a database restart or
    an idle timeout costs no request. One checked in a moment ago is used as it is: if
    the database went away in that moment, its statement fails once and SQLAlchemy
    invalidates the whole pool (a disconnect error), so the next unit of work reconnects.
    """

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # new (just connected), or used a moment ago
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            raise DisconnectionError(f"a pooled connection failed its ping: {exc}") from exc
        if not alive:
            raise DisconnectionError("a pooled connection failed its ping")


def _alembic(engine: Engine, step: Any, revision: str) -> None:
    """Run an Alembic ``step`` (upgrade or downgrade) to ``revision`` in one transaction.

    On SQLite, foreign keys are off while it runs and checked after: a batch migration
    rebuilds a table (copy, drop, rename), and with them on, dropping a table other rows
    point at fails — a downgrade with data in the tables did. SQLite ignores the pragma
    inside a transaction, so it is set on the connection before the transaction begins.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        if sqlite:
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()  # SQLAlchemy's own bookkeeping; SQLite began no transaction
        try:
            with conn.begin():
                cfg.attributes["connection"] = conn
                step(cfg, revision)
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"migration left rows without their parent: {broken}")
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema up to ``revision`` (default: the newest; idempotent).

    A schema already at the newest revision costs one read: every server, gateway-less
    test app and CLI command starts here, and Alembic loads every revision's file to
    find that out (~25 ms)."""
    if revision == "head" and _revision_of(engine) == head_revision():
        return
    _alembic(engine, command.upgrade, revision)


@functools.cache
def head_revision() -> str:
    """The newest revision of this install's migrations (read once per process)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return str(ScriptDirectory.from_config(cfg).get_current_head())


def _revision_of(engine: Engine) -> str | None:
    """The schema's revision, or None when it has none (a new database)."""
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").all()
    except SQLAlchemyError:
        return None
    return str(rows[0][0]) if len(rows) == 1 else None


def downgrade(engine: Engine, revision: str) -> None:
    """Take the schema down to ``revision`` (an operator's way back from an upgrade)."""
    _alembic(engine, command.downgrade, revision)


class Database:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    @classmethod
    def from_url(cls, url: str) -> Database:
        return cls(make_engine(url))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: committed on success, rolled back on any error."""
        with self._sessions() as s, s.begin():
            yield s

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """A connection whose statements each commit on their own: for work that is one
        read and at most one write (the heartbeat's refresh), without the two round
        trips of BEGIN and COMMIT, nor the session's machinery around them."""
        with self._autocommit.connect() as conn:
            yield conn

    @contextmanager
    def read_snapshot(self) -> Iterator[Session]:
        """A read-only unit of work whose statements all see one consistent state.

        Plain sessions read each statement at its own moment (READ COMMITTED on
        PostgreSQL; no transaction at all for reads on SQLite), so a write that lands
        between two reads shows half of itself. PostgreSQL: REPEATABLE READ, read only;
        SQLite (WAL): an explicit BEGIN, whose first read fixes the snapshot.
        """
        with self._sessions() as s:
            if self.engine.dialect.name == "postgresql":
                s.connection(
                    execution_options={"isolation_level": "REPEATABLE READ",
                                       "postgresql_readonly": True}
                )
            else:
                s.execute(text("BEGIN"))
            try:
                yield s
            finally:
                s.rollback()

    def dispose(self) -> None:
        self.engine.dispose()
