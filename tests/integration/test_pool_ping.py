"""PostgreSQL connections are pinged when they sat in the pool (db/engine.py): a
database restart or an idle timeout costs no request, and a connection used a moment
ago costs no round trip."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from heteroflow.db import engine as db_engine
from heteroflow.db.engine import make_engine


@pytest.fixture
def pg(pg_database: str) -> Iterator[Engine]:
    engine = make_engine(pg_database)
    yield engine
    engine.dispose()


def backend_pid(engine: Engine) -> int:
    with engine.connect() as c:
        return int(c.execute(text("SELECT pg_backend_pid()")).scalar_one())


def count_pings(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    pings: list[bool] = []
    real = engine.dialect.do_ping

    def ping(dbapi_conn: Any) -> bool:
        try:
            alive = bool(real(dbapi_conn))
        except Exception:
            pings.append(False)
            raise
        pings.append(alive)
        return alive

    monkeypatch.setattr(engine.dialect, "do_ping", ping)
    return pings


def test_a_connection_killed_while_idle_is_replaced_before_use(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db_engine, "PING_IDLE_S", 0.0)  # every check-out has sat "long"
    engine = make_engine(pg_database)
    try:
        pings = count_pings(engine, monkeypatch)
        pid = backend_pid(engine)
        with psycopg.connect(pg_database, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert backend_pid(engine) != pid  # pinged, found dead, replaced: no error
        assert pings == [False]  # the first check-out was a new connection: no ping
    finally:
        engine.dispose()


def test_a_connection_used_a_moment_ago_is_not_pinged(
    pg: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings = count_pings(pg, monkeypatch)
    backend_pid(pg)
    backend_pid(pg)  # well inside PING_IDLE_S of its check-in
    assert pings == []
