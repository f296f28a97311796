"""One create per name, whatever the concurrency (issue 26, item 2).

Every name the API keeps unique — a service's endpoint name in its tenant (which a
create takes from ``name``), a model route (model name → group) in a tenant, a tenant,
a user, a sharing group — is unique in the database, and a create or rename that loses
the race answers 409 naming the field. A task-group create is one transaction: the
loser leaves no group, task, route or endpoint behind, and no service is ever left
without its key.

Each test fires the same request from many threads at once against the real app
(SQLite and PostgreSQL); the route functions run in the app's thread pool, each in its
own unit of work.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from httpx2 import Response  # what the TestClient answers
from sqlalchemy import func, select

from heteroflow.db.tables import (
    InferenceEndpoint,
    ModelRoute,
    SharingGroup,
    Task,
    TaskGroup,
    Tenant,
    User,
)
from heteroflow.schemas.routing import hash_key

from .conftest import Api, service_body

# parallel requests per race: more than the app's 40 worker threads, as the attack was
# (50 creates of one service): a lock held across a thread hand-off stalled them all
# until the database's lock timeout (api/unit_of_work.py)
N = 50


def at_once(n: int, send: Callable[[int], Response]) -> list[Response]:
    """``send(i)`` from ``n`` threads released together."""
    start = threading.Barrier(n)

    def one(i: int) -> Response:
        start.wait(10)
        return send(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def one_winner(answers: list[Response], won: int, field: str) -> dict[str, Any]:
    """Exactly one ``won``, every other a 409 naming ``field``; the winner's body."""
    assert Counter(r.status_code for r in answers) == {won: 1, 409: len(answers) - 1}, [
        (r.status_code, r.text) for r in answers if r.status_code != 409
    ]
    for r in answers:
        if r.status_code == 409:
            err = r.json()["error"]
            assert err["code"] == "conflict" and err["field"] == field, err
            assert "already" in err["message"], err
    body: dict[str, Any] = next(r.json() for r in answers if r.status_code == won)
    return body


def count(api: Api, q: Any) -> int:
    with api.app.db.session() as s:
        return int(s.scalar(select(func.count()).select_from(q.subquery())) or 0)


@pytest.mark.feature("A3")
def test_parallel_creates_of_one_service_name_make_one_service_with_its_key(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team", "alice")
    api.heartbeat()

    answers = at_once(
        N, lambda _: api.client.post("/api/v1/task-groups", json=service_body(), headers=member)
    )

    created = one_winner(answers, 201, "name")
    assert created["api_key"] and created["endpoint"] and created["warnings"] == []
    assert count(api, select(TaskGroup.id)) == 1
    assert count(api, select(Task.id)) == 1
    assert count(api, select(ModelRoute.id)) == 1
    with api.app.db.session() as s:
        (endpoint,) = s.scalars(select(InferenceEndpoint)).all()
        group = s.get(TaskGroup, created["id"])
        assert group is not None and group.endpoint_id == endpoint.id == created["endpoint"]
        assert endpoint.name == "svc" and endpoint.group_id == group.id
        # the key the winner got is its endpoint's (no service without a key)
        assert endpoint.key_hash == hash_key(created["api_key"])


@pytest.mark.feature("A3")
def test_parallel_renames_to_one_endpoint_name_leave_one(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    ids = []
    for i in range(N):
        r = api.client.post(
            "/api/v1/task-groups", json=service_body(name=f"svc-{i}"), headers=admin
        )
        assert r.status_code == 201, r.text
        ids.append(r.json()["endpoint"])

    answers = at_once(
        N,
        lambda i: api.client.patch(
            f"/api/v1/gateway/endpoints/{ids[i]}", json={"name": "shared"}, headers=admin
        ),
    )

    one_winner(answers, 200, "name")
    assert count(api, select(InferenceEndpoint.id).where(InferenceEndpoint.name == "shared")) == 1


@pytest.mark.feature("A4")
def test_parallel_adds_of_one_route_leave_one(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    assert r.status_code == 201, r.text
    body = {"model_name": "alias", "group_id": r.json()["id"]}

    answers = at_once(
        N, lambda _: api.client.post("/api/v1/model-routes", json=body, headers=admin)
    )

    one_winner(answers, 201, "model_name")
    assert count(api, select(ModelRoute.id).where(ModelRoute.model_name == "alias")) == 1


@pytest.mark.feature("N1")
def test_parallel_creates_of_one_tenant_leave_one(api: Api) -> None:
    admin = api.login()

    answers = at_once(
        N, lambda _: api.client.post("/api/v1/tenants", json={"name": "team"}, headers=admin)
    )

    one_winner(answers, 201, "name")
    assert count(api, select(Tenant.id).where(Tenant.name == "team")) == 1


@pytest.mark.feature("N1")
def test_parallel_creates_of_one_user_leave_one(api: Api) -> None:
    admin = api.login()
    body = {"username": "alice", "password": "member-pass-1", "role": "member"}

    answers = at_once(
        N, lambda _: api.client.post("/api/v1/users", json=body, headers=admin)
    )

    one_winner(answers, 201, "username")
    assert count(api, select(User.id).where(User.username == "alice")) == 1


@pytest.mark.feature("N3")
def test_parallel_creates_of_one_sharing_group_leave_one(api: Api) -> None:
    admin = api.login()

    answers = at_once(
        N,
        lambda _: api.client.post("/api/v1/sharing-groups", json={"name": "lab"}, headers=admin),
    )

    one_winner(answers, 201, "name")
    assert count(api, select(SharingGroup.id).where(SharingGroup.name == "lab")) == 1
