"""The unit tier's guard (tests/unit/conftest.py) refuses network and database I/O."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import psycopg
import pytest

from .conftest import UnitTierIO


def test_sockets_cannot_bind_or_connect() -> None:
    with socket.socket() as s, pytest.raises(UnitTierIO, match="tests/integration"):
        s.bind(("127.0.0.1", 0))
    with socket.socket() as s, pytest.raises(UnitTierIO):
        s.connect(("127.0.0.1", 9))
    with pytest.raises(UnitTierIO):
        socket.create_connection(("127.0.0.1", 9))


def test_databases_cannot_be_opened(tmp_path: Path) -> None:
    with pytest.raises(UnitTierIO):
        sqlite3.connect(tmp_path / "x.db")
    with pytest.raises(UnitTierIO):
        psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres")


def test_files_under_tmp_path_are_allowed(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("ok")
    assert (tmp_path / "f").read_text() == "ok"
