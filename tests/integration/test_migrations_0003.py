"""Migration 0003 (task logs, file requests) upgrades a 0002 database (both databases)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from heteroflow.db.engine import make_engine, migrate
from heteroflow.db.tables import Base

NEW_TABLES = {"task_logs", "file_requests", "file_request_chunks"}


def test_upgrade_from_0002_adds_the_tables_and_keeps_rows(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        migrate(engine, "0002")
        with engine.begin() as c:
            c.execute(
                text(
                    "INSERT INTO nodes (id, name, address, runtime, gpus, cpu_count,"
                    " memory_total_mb, memory_available_mb, cpu_percent, memory_percent,"
                    " models, labels, engines, registered_at, last_heartbeat_at) VALUES"
                    " ('node-000000000001', 'n1', '127.0.0.1', 'process', '[]', 2, 1024,"
                    " 1024, 0, 0, '[]', '{}', '{}', '2026-01-01 00:00:00+00',"
                    " '2026-01-01 00:00:00+00')"
                )
            )
        assert not NEW_TABLES & set(inspect(engine).get_table_names())
        migrate(engine)
        migrate(engine)  # idempotent
        assert set(inspect(engine).get_table_names()) >= NEW_TABLES
        with engine.begin() as c:
            assert c.execute(text("SELECT name FROM nodes")).scalar_one() == "n1"
            version = c.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
            c.execute(
                text(
                    "INSERT INTO task_logs (task_id, seq, text, size_bytes, created_at)"
                    " VALUES ('task-000000000001', 1, 'hello', 5, '2026-01-01 00:00:00+00')"
                )
            )
            assert c.execute(text("SELECT id FROM task_logs")).scalar_one() >= 1
        assert version >= "0003"
        # the hand-written migration matches the ORM tables it creates
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        mine = [d for d in diff if NEW_TABLES & _tables_named(d)]
        assert mine == []
    finally:
        engine.dispose()


def _tables_named(diff: object) -> set[str]:
    """Table names an autogenerate diff entry touches (entries are tuples or lists)."""
    found: set[str] = set()
    stack = [diff]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(item)
        elif hasattr(item, "name") and isinstance(item.name, str):
            found.add(item.name)
            table = getattr(item, "table", None)
            if table is not None and isinstance(getattr(table, "name", None), str):
                found.add(table.name)
        elif isinstance(item, str):
            found.add(item)
    return found
