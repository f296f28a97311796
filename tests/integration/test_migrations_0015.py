"""Migration 0015: one route per (tenant, model name, group), held by the database.

An older database may hold duplicates: the upgrade keeps one of each (the group's own
route first, then the oldest) and the unique index then refuses a new one, as a unique
violation ``services.unique`` recognises on both databases. Down and up again.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from heteroflow.db.engine import downgrade, make_engine, migrate
from heteroflow.db.tables import Base, ModelRoute, Tenant
from heteroflow.services.unique import is_unique_violation

T0 = datetime(2027, 1, 1, tzinfo=UTC)


def route(rid: str, model: str, group: str, *, added: bool, minutes: int) -> ModelRoute:
    at = T0 + timedelta(minutes=minutes)
    return ModelRoute(
        id=rid, tenant_id="tn-1", group_id=group, model_name=model, priority=0, weight=100,
        version="v1", active=True, algorithm="round_robin", tags=[], added=added,
        created_at=at, updated_at=at,
    )


def route_ids(engine: Engine) -> set[str]:
    with Session(engine) as s:
        return set(s.scalars(select(ModelRoute.id)))


def test_0015_keeps_one_of_each_route_and_refuses_the_next(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        migrate(engine, "0014")
        with Session(engine) as s, s.begin():
            s.add(Tenant(id="tn-1", name="team", created_at=T0))
            s.flush()
            s.add_all([
                route("mr-own", "m", "tg-1", added=False, minutes=2),  # kept: the group's
                route("mr-old", "m", "tg-1", added=True, minutes=0),
                route("mr-new", "m", "tg-1", added=True, minutes=1),
                route("mr-twin-a", "m", "tg-2", added=True, minutes=0),  # kept: smaller id
                route("mr-twin-b", "m", "tg-2", added=True, minutes=0),
                route("mr-canary", "m", "tg-3", added=True, minutes=0),  # another group
                route("mr-alias", "alias", "tg-1", added=True, minutes=0),  # another name
            ])

        migrate(engine, "0015")

        assert route_ids(engine) == {"mr-own", "mr-twin-a", "mr-canary", "mr-alias"}
        with engine.connect() as conn:  # the hand-written index is the ORM's
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert [d for d in diff if "model_routes" in repr(d)] == []
        with Session(engine) as s, pytest.raises(IntegrityError) as refused, s.begin():
            s.add(route("mr-again", "m", "tg-1", added=True, minutes=5))
        assert is_unique_violation(refused.value)

        downgrade(engine, "0014")
        with Session(engine) as s, s.begin():  # no index: a duplicate is written again
            s.add(route("mr-again", "m", "tg-1", added=True, minutes=5))
        migrate(engine, "0015")
        assert "mr-again" not in route_ids(engine) and "mr-own" in route_ids(engine)
    finally:
        engine.dispose()
