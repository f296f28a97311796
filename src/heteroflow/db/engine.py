"""Database engines: SQLite (WAL, the embedded default) or PostgreSQL by URL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from heteroflow.private_files import private_file

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# JSON columns (node inventories, task ports and cards) go through orjson: the scheduler
# reads every node's cards each round, so (de)serialisation is on its hot path.
_JSON = {"json_serializer": _json_dumps, "json_deserializer": orjson.loads}


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
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10, **_JSON)


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (default: the newest; idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


class Database:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def from_url(cls, url: str) -> Database:
        return cls(make_engine(url))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: committed on success, rolled back on any error."""
        with self._sessions() as s, s.begin():
            yield s

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
