"""The unit tier does no I/O beyond files under ``tmp_path``.

An autouse guard makes every network socket (connect, bind) and every database
connection (sqlite3, psycopg) fail inside a unit test, so a test that needs a server, a
port or a database cannot land here by accident: it belongs in tests/integration.
"""

from __future__ import annotations

import socket
import sqlite3
import sqlite3.dbapi2
from typing import Any, NoReturn

import pytest


class UnitTierIO(AssertionError):
    """A unit test tried to reach the network or a database."""


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise UnitTierIO(
            f"unit tests do no I/O: {what} was called — move this test to tests/integration"
        )

    return refuse


@pytest.fixture(autouse=True)
def no_network_or_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket.socket, "connect", _refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("socket.connect_ex"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("socket.bind"))
    monkeypatch.setattr(socket, "create_connection", _refuse("socket.create_connection"))
    monkeypatch.setattr(socket, "create_server", _refuse("socket.create_server"))
    monkeypatch.setattr(sqlite3, "connect", _refuse("sqlite3.connect"))
    # SQLAlchemy's pysqlite dialect calls sqlite3.dbapi2.connect, a name of its own
    monkeypatch.setattr(sqlite3.dbapi2, "connect", _refuse("sqlite3.dbapi2.connect"))
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return
    monkeypatch.setattr(psycopg, "connect", _refuse("psycopg.connect"))
    monkeypatch.setattr(psycopg.Connection, "connect", _refuse("psycopg.Connection.connect"))
