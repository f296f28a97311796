"""Every Alembic revision goes down and back up, with rows in the tables (issue 18, P1).

A server starts on an empty database (migrating it to the head and seeding it), a
service is created through the API, and the schema is then taken down one revision at a
time to the first one and brought back up one at a time, on SQLite and PostgreSQL. Each
step must succeed with those rows present, and the rows of tables the first revision
already had (tenants, users, task groups, tasks) must survive the whole trip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text

from heteroflow.core.clock import FakeClock
from heteroflow.db.engine import MIGRATIONS_DIR, downgrade, make_engine, migrate
from heteroflow.db.tables import Task, TaskGroup, Tenant, User
from heteroflow.server import ServerApp
from heteroflow.settings import ServerSettings

from .conftest import ADMIN_PASSWORD, NODE_TOKEN, service_body


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def _step(engine: Engine, up: bool, revision: str) -> None:
    (migrate if up else downgrade)(engine, revision)


def _version(engine: Engine) -> str:
    with engine.connect() as c:
        return str(c.execute(text("SELECT version_num FROM alembic_version")).scalar_one())


def _serve(url: str, tmp_path: Path, services: list[str]) -> list[str]:
    """A server migrates ``url`` and seeds it; a service of each name is created through
    its API. Returns each service's first task id."""
    settings = ServerSettings(
        data_dir=tmp_path / "data", database_url=url, admin_password=ADMIN_PASSWORD,
        node_token=NODE_TOKEN, gateway_token="gw-token-for-tests",
    )
    app = ServerApp(settings, clock=FakeClock())
    ids = []
    with TestClient(app.asgi) as client:
        r = client.post(
            "/api/v1/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}
        )
        admin = {"Authorization": f"Bearer {r.json()['access_token']}"}
        for name in services:
            created = client.post(
                "/api/v1/task-groups", json=service_body(name=name), headers=admin
            )
            assert created.status_code == 201, created.text
            ids.append(str(created.json()["tasks"][0]["id"]))
    app.db.dispose()
    return ids


def _counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as c:
        return {
            t.__tablename__: int(c.execute(select(func.count()).select_from(t)).scalar_one())
            for t in (Tenant, User, TaskGroup, Task)
        }


@pytest.mark.feature("P1")
def test_every_revision_goes_down_and_up_with_rows_in_the_tables(
    empty_db_url: str, tmp_path: Path
) -> None:
    _serve(empty_db_url, tmp_path, ["svc"])

    revisions = [
        s.revision for s in reversed(list(ScriptDirectory.from_config(_config()).walk_revisions()))
    ]
    engine = make_engine(empty_db_url)
    try:
        assert _version(engine) == revisions[-1]
        before = _counts(engine)
        assert before[TaskGroup.__tablename__] == 1 and before[Task.__tablename__] >= 1
        for previous in reversed(revisions[:-1]):  # head-1 … first: each step down
            _step(engine, False, previous)
            assert _version(engine) == previous
        assert _counts(engine) == before  # the first revision's tables kept their rows
        for revision in revisions[1:]:  # and back up, one step at a time
            _step(engine, True, revision)
            assert _version(engine) == revision
        assert _counts(engine) == before
    finally:
        engine.dispose()


def test_the_cli_takes_the_schema_down_and_back_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from heteroflow import cli

    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("HETEROFLOW_DATABASE_URL", raising=False)
    assert cli.main(["migrate"]) == 0
    engine = make_engine(f"sqlite:///{tmp_path / 'heteroflow.db'}")
    try:
        head = _version(engine)
        assert cli.main(["migrate", "--down-to", "0013"]) == 0
        assert _version(engine) == "0013"
        assert "revision 0013" in capsys.readouterr().out
        assert cli.main(["migrate"]) == 0
        assert _version(engine) == head
    finally:
        engine.dispose()


@pytest.mark.feature("N4")
def test_0014_opens_gpu_time_for_tasks_already_holding_cards(
    empty_db_url: str, tmp_path: Path
) -> None:
    """Tasks that hold cards when 0014 is applied are metered from then on."""
    ids = _serve(empty_db_url, tmp_path, ["half", "pair", "asleep", "queued"])
    # as the 0013 code would have left them: one card at 50 %, two whole cards, one
    # card at 40 % asleep, and a task still queued
    shapes = [("running", 1, 50), ("starting", 2, 90), ("sleeping", 1, 40), ("pending", 1, 50)]
    engine = make_engine(empty_db_url)
    try:
        downgrade(engine, "0013")
        with engine.begin() as c:
            for task_id, (status, cards, pct) in zip(ids, shapes, strict=True):
                c.execute(
                    text(
                        "UPDATE tasks SET status = :st, gpu_required = :n,"
                        " gpu_memory_utilization = :pct WHERE id = :id"
                    ),
                    {"st": status, "n": cards, "pct": pct, "id": task_id},
                )
        migrate(engine, "0014")
        with engine.connect() as c:
            rows = c.execute(
                text(
                    "SELECT task_id, state, card_pct, user_id <> '', ended_at"
                    " FROM gpu_time_segments"
                )
            ).all()
    finally:
        engine.dispose()
    assert sorted(tuple(r) for r in rows) == sorted(
        [
            (ids[0], "running", 50, True, None),
            (ids[1], "running", 200, True, None),
            (ids[2], "sleeping", 40, True, None),
        ]
    )
