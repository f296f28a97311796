"""Schema migrations keep existing rows (both databases)."""

from __future__ import annotations

from sqlalchemy import text

from heteroflow.db.engine import make_engine, migrate


def test_upgrade_from_the_first_schema_keeps_rows_and_fills_defaults(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        migrate(engine, "0001")
        with engine.begin() as c:
            c.execute(
                text(
                    "INSERT INTO nodes (id, name, address, runtime, gpus, cpu_count,"
                    " memory_total_mb,"
                    " memory_available_mb, cpu_percent, memory_percent, models, labels,"
                    " registered_at, last_heartbeat_at) VALUES ('node-000000000001', 'n1',"
                    " '127.0.0.1', 'process', '[]', 2, 1024, 1024, 0, 0, '[]', '{}',"
                    " '2026-01-01 00:00:00+00', '2026-01-01 00:00:00+00')"
                )
            )
        migrate(engine)
        migrate(engine)  # idempotent
        with engine.begin() as c:
            row = c.execute(text("SELECT name, engines FROM nodes")).one()
            version = c.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        assert row[0] == "n1"
        assert row[1] in ({}, "{}")
        assert version >= "0002"
    finally:
        engine.dispose()
