"""Migration 0020: a usage record keeps its service (issue 33).

Records written before it take their endpoint's service where the endpoint still exists;
those of endpoints deleted before it stay without one. The column is the ORM's, and the
schema goes down and up again.
"""

from __future__ import annotations

from datetime import UTC, datetime

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from heteroflow.db.engine import downgrade, make_engine, migrate
from heteroflow.db.tables import Base, InferenceEndpoint, Tenant

T0 = datetime(2027, 1, 1, tzinfo=UTC)


def endpoint(eid: str, group: str | None) -> InferenceEndpoint:
    return InferenceEndpoint(
        id=eid, tenant_id="tn-1", group_id=group, name=eid, port=8000, key_hash=eid,
        key_prefix="sk-x", created_by="us-1", created_at=T0, updated_at=T0,
    )

RECORD = (
    "INSERT INTO usage_records (recorded_at, endpoint_id, tenant_id, user_id, model_name,"
    " requests, prompt_tokens, completion_tokens) VALUES ('2027-01-01 00:00:00+00', :ep,"
    " 'tn-1', 'us-1', 'm', 1, 1, 1)"
)


def services(engine: Engine) -> dict[str, str | None]:
    with engine.connect() as c:
        rows = c.execute(text("SELECT endpoint_id, group_id FROM usage_records"))
        return {ep: group for ep, group in rows}


def test_0020_gives_old_records_their_endpoints_service(empty_db_url: str) -> None:
    engine = make_engine(empty_db_url)
    try:
        migrate(engine, "0019")
        with Session(engine) as s, s.begin():
            s.add(Tenant(id="tn-1", name="team", created_at=T0))
            s.flush()
            s.add_all([endpoint("ep-live", "tg-1"), endpoint("ep-free", None)])
        with engine.begin() as c:
            for ep in ("ep-live", "ep-free", "ep-deleted"):
                c.execute(text(RECORD), {"ep": ep})

        migrate(engine, "0020")

        assert services(engine) == {"ep-live": "tg-1", "ep-free": None, "ep-deleted": None}
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert [d for d in diff if "usage_records" in repr(d)] == []
        downgrade(engine, "0019")
        migrate(engine)
        assert services(engine)["ep-live"] == "tg-1"
    finally:
        engine.dispose()
