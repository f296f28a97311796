"""Shared fixtures and the FEATURES.md report.

``pytest --features`` prints, after the run, which FEATURES.md rows have passing tests
(rows come from ``@pytest.mark.feature("ID")``).

Databases: ``db_url`` runs a test on SQLite and on PostgreSQL (a throw-away database
per test session on 127.0.0.1:5432). When PostgreSQL cannot be reached the PostgreSQL
half is skipped with the reason — unless HETEROFLOW_REQUIRE_POSTGRES=1 (set by
``.ci/run``), which turns that into a failure.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get("HETEROFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")

_feature_results: dict[str, list[str]] = defaultdict(list)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--features", action="store_true", help="print FEATURES.md row coverage")


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.when != "call":
        return
    for mark in item.iter_markers("feature"):
        for fid in mark.args:
            _feature_results[str(fid)].append("passed" if call.excinfo is None else "failed")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not terminalreporter.config.getoption("--features"):
        return
    terminalreporter.section("FEATURES.md rows with tests")
    for fid in sorted(
        _feature_results, key=lambda f: (f[0], int("".join(c for c in f[1:] if c.isdigit()) or 0))
    ):
        res = _feature_results[fid]
        ok = res.count("passed")
        terminalreporter.write_line(f"{fid:5} {ok}/{len(res)} passing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this session; dropped at the end."""
    try:
        import psycopg

        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except Exception as exc:  # pragma: no cover - depends on the machine
        if os.environ.get("HETEROFLOW_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL required but unreachable at {PG_ADMIN_URL}: {exc}")
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc}")
    name = f"hf_test_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hf.db'}"
        return
    url: str = request.getfixturevalue("pg_database")
    yield url
    # each test starts from an empty schema on the shared session database
    from sqlalchemy import create_engine, text

    eng = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with eng.begin() as c:
        c.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    eng.dispose()
