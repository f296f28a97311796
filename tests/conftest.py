"""Shared fixtures and the FEATURES.md report.

``pytest --features`` prints, after the run, which FEATURES.md rows have passing tests
(rows come from ``@pytest.mark.feature("ID")``). A skipped test does not count as
passing: a row whose tests were all skipped is listed as such, never as proven.

Databases: ``db_url`` runs a test on SQLite and on PostgreSQL (a throw-away database
per test session on 127.0.0.1:5432). When PostgreSQL cannot be reached the PostgreSQL
half is skipped with the reason — unless HETEROFLOW_REQUIRE_POSTGRES=1 (set by
``.ci/run``), which turns that into a failure.

Each test gets the schema at its newest revision and no rows, without running the
migrations again (~0.1 s a test, 900 tests): SQLite copies a file migrated once per
session; PostgreSQL empties the session database's tables (TRUNCATE) when its schema is
at the head, and rebuilds it otherwise (a test that migrated down, a server of an e2e
test). Tests of the migrations themselves take ``empty_db_url``: no schema at all.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections import defaultdict
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

PG_ADMIN_URL = os.environ.get("HETEROFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")



def _hash_each_password_once() -> None:
    """scrypt is slow on purpose (~60 ms here), and every in-process server of a test
    hashes its admin's password at bootstrap and again at each login: ~2 minutes of the
    suite. In this process each distinct password gets one real salted hash, reused, and
    scrypt answers an input it already computed from a cache: every result is exactly
    scrypt's (a wrong password still fails, a reset still changes the hash), and a test
    that counts scrypt calls still sees each one. Servers a test starts as processes
    are not affected."""
    import functools
    import hashlib

    from heteroflow.services.identity import auth, login, passwords
    from heteroflow.services.tenancy import tenants

    real_scrypt = hashlib.scrypt

    @functools.lru_cache(maxsize=4096)
    def computed(password: bytes, salt: bytes, n: int, r: int, p: int, maxmem: int,
                 dklen: int) -> bytes:
        return real_scrypt(password, salt=salt, n=n, r=r, p=p, maxmem=maxmem, dklen=dklen)

    def scrypt(password: bytes, *, salt: bytes, n: int, r: int, p: int, maxmem: int = 0,
               dklen: int = 64) -> bytes:
        return computed(bytes(password), bytes(salt), n, r, p, maxmem, dklen)

    hashlib.scrypt = scrypt  # type: ignore[assignment]
    once = functools.lru_cache(maxsize=1024)(passwords.hash_password)
    for module in (passwords, auth, login, tenants):  # imported by name in the others
        vars(module)["hash_password"] = once


_hash_each_password_once()

# row -> test id -> outcome of that test (its worst phase: failed > skipped > passed)
_feature_results: dict[str, dict[str, str]] = defaultdict(dict)
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--features", action="store_true", help="print FEATURES.md row coverage")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The rows a test stands for ride on its report, so that the process that prints the
    summary counts them — this one, or the controller of ``-n`` workers (pytest-xdist)."""
    for mark in item.iter_markers("feature"):
        for fid in mark.args:
            if ("feature", str(fid)) not in item.user_properties:
                item.user_properties.append(("feature", str(fid)))
    return (yield)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and report.outcome == "passed":
        return  # a passing setup or teardown says nothing; a skip or error in one does
    outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    for name, fid in report.user_properties:
        if name == "feature":
            seen = _feature_results[str(fid)]
            old = seen.get(report.nodeid, "passed")
            seen[report.nodeid] = max(old, outcome, key=_RANK.__getitem__)


# With ``-n N`` (pytest-xdist, ``--dist loadscope``: scripts/test) a worker takes whole
# work units. The tiers that share one machine-wide thing — the private Docker Engine
# (scripts/test-dockerd, stopped by the session that started it), network namespaces,
# the block-I/O cgroup, several real engines at once — and the modules that measure real
# engines against each other (a ratio another worker's vLLM start would skew) are one
# unit, run in order on one worker; every other module is a unit of its own.
SERIAL = (
    "tests/docker/",
    "tests/e2e/",
    "tests/integration/test_gateway_capacity_real.py",
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    # xdist's own loadgroup marks a test id that pytest 9 no longer reads: the unit is
    # decided here, from the test's path, where the controller schedules
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "serial" if path.startswith(SERIAL) else path

    return TierScheduling(config, log)


def _row_order(fid: str) -> tuple[str, int]:
    return fid[0], int("".join(c for c in fid[1:] if c.isdigit()) or 0)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not terminalreporter.config.getoption("--features"):
        return
    terminalreporter.section("FEATURES.md rows with tests")
    terminalreporter.write_line(
        "passing = tests that ran and passed; a skipped test (no PostgreSQL, no Docker, "
        "no GPU...) or an xfailed one (known not built) does not count as passing"
    )
    only_skipped: list[str] = []
    for fid in sorted(_feature_results, key=_row_order):
        res = list(_feature_results[fid].values())
        counts = {o: res.count(o) for o in ("skipped", "xfailed", "failed")}
        extra = "".join(f", {n} {what}" for what, n in counts.items() if n)
        terminalreporter.write_line(f"{fid:5} {res.count('passed')}/{len(res)} passing{extra}")
        if counts["skipped"] + counts["xfailed"] == len(res):
            only_skipped.append(fid)
    if only_skipped:
        terminalreporter.write_line(
            "rows whose tests were all skipped or xfailed (not proven by this run): "
            + ", ".join(only_skipped)
        )


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


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database migrated to the head once per session (copied per test)."""
    from heteroflow.db.engine import make_engine, migrate

    path = tmp_path_factory.mktemp("db-template") / "hf.db"
    engine = make_engine(f"sqlite:///{path}")
    migrate(engine)
    engine.dispose()  # the last connection's close checkpoints the WAL into the file
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database at the newest schema revision, with no rows."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        target = tmp_path / "hf.db"
        target.write_bytes(template.read_bytes())
        target.chmod(0o600)
        yield f"sqlite:///{target}"
        return
    url: str = request.getfixturevalue("pg_database")
    # empty whatever used the shared session database before (an e2e test's servers
    # write it directly, without this fixture)
    _reset_schema(url)
    yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without any schema: for tests of the migrations."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hf.db'}"
        return
    url: str = request.getfixturevalue("pg_database")
    _drop_schema(url)
    yield url
    _drop_schema(url)


@pytest.fixture
def pg_empty_url(pg_database: str) -> str:
    """The session's PostgreSQL database without any schema, for servers a test starts
    itself (they migrate it): whatever earlier tests left there is gone."""
    _drop_schema(pg_database)
    return pg_database


def _sa_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://")


def _drop_schema(url: str) -> None:
    from sqlalchemy import create_engine, text

    eng = create_engine(_sa_url(url))
    with eng.begin() as c:
        c.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    eng.dispose()


_RESET_ENGINES: dict[str, Any] = {}


def _reset_schema(url: str) -> None:
    """Empty every table when the schema is at the head; otherwise rebuild it."""
    from sqlalchemy import create_engine, inspect, text

    from heteroflow.db.engine import head_revision, make_engine, migrate
    from heteroflow.db.tables import Base

    wanted = {t.name for t in Base.metadata.sorted_tables}
    eng = _RESET_ENGINES.get(url)
    if eng is None:  # one pooled connection per database for the session (never
        # prepared: other code drops and rebuilds the schema under it)
        eng = _RESET_ENGINES[url] = create_engine(
            _sa_url(url), pool_size=1, connect_args={"prepare_threshold": None}
        )
    try:
        with eng.begin() as c:
            tables = set(inspect(c).get_table_names())
            version = (
                c.execute(text("SELECT version_num FROM alembic_version")).scalar()
                if "alembic_version" in tables
                else None
            )
            if version == head_revision() and tables - {"alembic_version"} == wanted:
                # DELETE, dependents first: a test leaves a few rows, and TRUNCATE's
                # fixed cost per table (new files, locks) made it 10x slower (46 vs 5 ms
                # for the 19 tables, once per PostgreSQL test)
                for table in reversed(Base.metadata.sorted_tables):
                    c.execute(table.delete())
                for (seq,) in c.execute(text(
                    "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public'"
                    " AND last_value IS NOT NULL"
                )):
                    c.execute(text(f'ALTER SEQUENCE "{seq}" RESTART'))
                return
            c.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    except Exception:
        eng.dispose()  # a connection that failed is not kept
        raise
    engine = make_engine(url)
    try:
        migrate(engine)
    finally:
        engine.dispose()
