"""The routing snapshot is built from one consistent state of the database: a write
that lands between its reads must not show half of itself (a key without its model)."""

from __future__ import annotations

from sqlalchemy import func, select

from heteroflow.db.tables import Tenant

from .conftest import Api


def test_reads_inside_one_snapshot_do_not_see_later_commits(api: Api) -> None:
    db = api.app.db
    with db.read_snapshot() as snap:
        before = snap.scalar(select(func.count()).select_from(Tenant))
        assert before is not None
        with db.session() as writer:  # another connection commits meanwhile
            writer.add(Tenant(id="tn-0000000000aa", name="late", created_at=api.clock.now()))
        assert snap.scalar(select(func.count()).select_from(Tenant)) == before
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Tenant)) == before + 1
