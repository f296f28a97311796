"""Route creation and group deletion serialise (issue 10): a route added while its group
is being deleted never stays active on the deleted group, whichever commits first.

The two operations run in two real transactions on the real database; the second is
started while the first is still open, and must wait for it (row lock on PostgreSQL,
the write lock on SQLite) rather than act on what it read before.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import select

from heteroflow.core.errors import NotFound
from heteroflow.db.tables import ModelRoute, User
from heteroflow.schemas.gateway import ModelRouteCreate
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle import task_groups
from heteroflow.services.serving import endpoints

from .conftest import Api, service_body


def admin_principal(api: Api) -> Principal:
    with api.app.db.session() as s:
        u = s.scalars(select(User).where(User.username == "admin")).one()
        return Principal(u.id, u.username, u.tenant_id, u.role)


def group(api: Api) -> str:
    admin = api.login()
    api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def routes_of(api: Api, group_id: str) -> list[Any]:
    with api.app.db.session() as s:
        return list(s.scalars(select(ModelRoute).where(ModelRoute.group_id == group_id)))


def in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_a_route_added_before_the_delete_commits_is_deleted_with_the_group(api: Api) -> None:
    gid = group(api)
    who = admin_principal(api)
    req = ModelRouteCreate(group_id=gid, model_name="alias")
    with api.app.db.session() as s1:  # the route insert, still open
        endpoints.create_route(s1, who, api.clock, req)

        def delete() -> None:
            with api.app.db.session() as s2:
                task_groups.delete_group(s2, who, api.clock, gid)

        t, errors = in_thread(delete)
        t.join(0.5)
        assert t.is_alive(), "the delete must wait for the open route insert"
    t.join(30)
    assert not t.is_alive() and not errors, errors
    assert routes_of(api, gid) == []


def test_a_route_added_while_the_delete_is_open_is_refused(api: Api) -> None:
    gid = group(api)
    who = admin_principal(api)
    req = ModelRouteCreate(group_id=gid, model_name="alias")
    with api.app.db.session() as s1:  # the delete, still open
        task_groups.delete_group(s1, who, api.clock, gid)

        def add() -> None:
            with api.app.db.session() as s2:
                endpoints.create_route(s2, who, api.clock, req)

        t, errors = in_thread(add)
        t.join(0.5)
        assert t.is_alive(), "the route insert must wait for the open delete"
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], NotFound), errors
    assert routes_of(api, gid) == []
