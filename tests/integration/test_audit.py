"""The audit log of management writes (issue 10, item 9) on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.db.tables import AuditRecord
from heteroflow.services.identity import audit
from heteroflow.services.lifecycle import task_groups

from .conftest import NODE_TOKEN, Api, service_body

MEMBER_PASSWORD = "member-pass-1"


def group_body(name: str = "svc") -> dict[str, Any]:
    # a model name (resolved under /data/models on the node): no volume rule involved
    return service_body(name=name, task={"model_path": "tiny.gguf"})


def rows(api: Api) -> list[AuditRecord]:
    with api.app.db.session() as s:
        return list(s.scalars(select(AuditRecord).order_by(AuditRecord.id)))


def make_member(api: Api, admin: dict[str, str], tenant: str, username: str) -> dict[str, Any]:
    t = api.client.post("/api/v1/tenants", json={"name": tenant}, headers=admin)
    assert t.status_code == 201, t.text
    u = api.client.post(
        "/api/v1/users",
        json={"username": username, "password": MEMBER_PASSWORD, "tenant_id": t.json()["id"]},
        headers=admin,
    )
    assert u.status_code == 201, u.text
    return {
        "headers": api.login(username, MEMBER_PASSWORD),
        "user_id": u.json()["id"],
        "tenant_id": t.json()["id"],
        "username": username,
    }


def test_member_writes_are_recorded_with_who_what_when_and_from_where(api: Api) -> None:
    admin = api.login()
    m = make_member(api, admin, "team-a", "alice")
    api.clock.advance(60)
    created = api.client.post("/api/v1/task-groups", json=group_body(), headers=m["headers"])
    assert created.status_code == 201, created.text
    gid = created.json()["id"]
    bad = group_body()
    bad["image"] = "x"  # a container field at the top level: 400
    failed = api.client.post("/api/v1/task-groups", json=bad, headers=m["headers"])
    assert failed.status_code == 400
    deleted = api.client.delete(f"/api/v1/task-groups/{gid}", headers=m["headers"])
    assert deleted.status_code == 204

    mine = [r for r in rows(api) if r.user_id == m["user_id"]]
    assert [(r.method, r.path, r.status) for r in mine] == [
        ("POST", "/api/v1/task-groups", 201),
        ("POST", "/api/v1/task-groups", 400),
        ("DELETE", f"/api/v1/task-groups/{gid}", 204),
    ]
    for r in mine:
        assert (r.username, r.tenant_id, r.role) == ("alice", m["tenant_id"], "member")
        assert r.remote_addr == "testclient"  # the TestClient's peer address
        assert r.created_at == api.clock.now()
    assert mine[2].detail == f"group_id={gid}"
    # the operator's writes are there too; the member's password (in a body) is not
    ops = [r for r in rows(api) if r.role == "operator"]
    assert [(r.method, r.path, r.status) for r in ops] == [
        ("POST", "/api/v1/tenants", 201),
        ("POST", "/api/v1/users", 201),
    ]
    assert not any(
        MEMBER_PASSWORD in str(getattr(r, c.name))
        for r in rows(api)
        for c in AuditRecord.__table__.columns
    )
    # reads are not writes
    api.client.get("/api/v1/task-groups", headers=m["headers"])
    assert not any(r.method == "GET" for r in rows(api))


def test_operator_reads_newest_first_with_filters_and_keyset_pages(api: Api) -> None:
    admin = api.login()
    a = make_member(api, admin, "team-a", "alice")
    b = make_member(api, admin, "team-b", "bob")
    api.clock.advance(3600)
    since = api.clock.now().isoformat()
    for i, who in enumerate((a, b, a)):
        body = group_body(f"svc-{i}")
        r = api.client.post("/api/v1/task-groups", json=body, headers=who["headers"])
        assert r.status_code == 201, r.text
    gid = r.json()["id"]
    assert api.client.delete(f"/api/v1/task-groups/{gid}", headers=a["headers"]).status_code == 204

    page = api.client.get("/api/v1/audit", headers=admin)
    assert page.status_code == 200, page.text
    recs = page.json()["records"]
    ids = [x["id"] for x in recs]
    assert ids == sorted(ids, reverse=True)  # newest first
    assert recs[0]["method"] == "DELETE" and recs[0]["detail"] == f"group_id={gid}"
    assert page.json()["next_before_id"] is None

    def get(**params: Any) -> list[dict[str, Any]]:
        r = api.client.get("/api/v1/audit", params=params, headers=admin)
        assert r.status_code == 200, r.text
        return list(r.json()["records"])

    alice = get(user_id=a["user_id"])
    assert [(x["method"], x["status"]) for x in alice] == [
        ("DELETE", 204),
        ("POST", 201),
        ("POST", 201),
    ]
    assert all(x["username"] == "alice" for x in alice)
    assert [x["username"] for x in get(tenant_id=b["tenant_id"])] == ["bob"]
    assert [x["method"] for x in get(method="delete")] == ["DELETE"]
    recent = get(since=since)
    assert len(recent) == 4 and {x["username"] for x in recent} == {"alice", "bob"}
    # the logins are recorded with no user
    logins = get(user_id="")
    assert logins and all(x["path"] == "/api/v1/auth/login" for x in logins)

    # keyset pages of 2 walk every row exactly once
    seen: list[int] = []
    before: int | None = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if before is not None:
            params["before_id"] = before
        r = api.client.get("/api/v1/audit", params=params, headers=admin).json()
        seen += [x["id"] for x in r["records"]]
        before = r["next_before_id"]
        if before is None:
            break
    assert seen == [x["id"] for x in get(limit=1000)]
    assert len(seen) == len(rows(api))


@pytest.mark.feature("N1")
def test_the_audit_log_is_for_operators_only(api: Api) -> None:
    admin = api.login()
    m = make_member(api, admin, "team-a", "alice")
    r = api.client.get("/api/v1/audit", headers=m["headers"])
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "forbidden"
    assert api.client.get("/api/v1/audit").status_code == 401
    bad = {"Authorization": "Bearer not-a-token"}
    assert api.client.get("/api/v1/audit", headers=bad).status_code == 401


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 1001},
        {"limit": 2**31},
        {"limit": "x"},
        {"before_id": -1},
        {"before_id": 2**31},
        {"before_id": 10**40},
        {"method": "GET"},
        {"method": "POSTPOSTPOST"},
        {"since": "yesterday"},
        {"since": "9999-12-31T23:00:00-05:00"},
        {"since": "0001-01-01T00:30:00+05:00"},
        {"user_id": "a\x00b"},
        {"tenant_id": "t" * 33},
    ],
)
def test_query_parameters_out_of_range_are_400(api: Api, params: dict[str, Any]) -> None:
    admin = api.login()
    r = api.client.get("/api/v1/audit", params=params, headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "validation_error"


def test_failed_login_is_recorded_without_user_or_password(api: Api) -> None:
    secret = "wrong-pass-Zq81"  # what an attacker tried
    r = api.client.post("/api/v1/auth/login", json={"username": "admin", "password": secret})
    assert r.status_code == 401
    api.login()
    logins = [x for x in rows(api) if x.path == "/api/v1/auth/login"]
    assert [(x.method, x.status, x.user_id, x.username, x.remote_addr) for x in logins] == [
        ("POST", 401, "", "", "testclient"),
        ("POST", 200, "", "", "testclient"),
    ]
    for x in rows(api):
        for c in AuditRecord.__table__.columns:
            value = str(getattr(x, c.name))
            assert secret not in value and "admin-pass-for-tests" not in value


def test_machine_calls_are_not_recorded_but_bad_tokens_are(api: Api) -> None:
    admin = api.login()
    before = len(rows(api))
    api.heartbeat()
    api.heartbeat()
    usage = api.client.post(
        "/api/v1/gateway/usage",
        json={"records": []},
        headers={"Authorization": "Bearer gw-token-for-tests"},
    )
    assert usage.status_code == 200, usage.text
    assert len(rows(api)) == before
    # someone without the node token is recorded
    forged = api.client.post(
        "/api/v1/agent/heartbeat", json={}, headers={"Authorization": "Bearer guess"}
    )
    assert forged.status_code == 401
    # an operator handing in usage is a management write
    assert (
        api.client.post("/api/v1/gateway/usage", json={"records": []}, headers=admin).status_code
        == 200
    )
    new = rows(api)[before:]
    assert [(x.path, x.status, x.role) for x in new] == [
        ("/api/v1/agent/heartbeat", 401, ""),
        ("/api/v1/gateway/usage", 200, "operator"),
    ]
    assert NODE_TOKEN not in str([x.detail for x in new])


def test_a_failing_audit_write_does_not_change_the_answer(
    api: Api, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    admin = api.login()
    before = len(rows(api))

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("audit table is gone")

    monkeypatch.setattr(audit, "record", broken)
    with caplog.at_level(logging.WARNING, logger="heteroflow.api.audit_middleware"):
        r = api.client.post("/api/v1/task-groups", json=group_body(), headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["id"].startswith("tg-")
    assert len(rows(api)) == before
    assert "audit record not written (POST /api/v1/task-groups -> 201): RuntimeError" in (
        caplog.text
    )


def test_an_unhandled_error_is_recorded_as_500(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = api.login()

    def boom(*_: Any, **__: Any) -> None:
        raise ValueError("bug")

    monkeypatch.setattr(task_groups, "delete_group", boom)
    with pytest.raises(ValueError):  # the TestClient re-raises what the server answered 500 to
        api.client.delete("/api/v1/task-groups/tg-000000000000", headers=admin)
    last = rows(api)[-1]
    assert (last.method, last.status, last.role) == ("DELETE", 500, "operator")
    assert last.detail == "group_id=tg-000000000000 error=ValueError"


def test_odd_paths_and_query_names_are_stored_safely(api: Api) -> None:
    admin = api.login()
    long_tail = "x" * 600
    r = api.client.post(f"/api/v1/nowhere%00{long_tail}?dry_run=true&b=secret", headers=admin)
    assert r.status_code == 404
    last = rows(api)[-1]
    assert last.path.startswith("/api/v1/nowhere\ufffdx") and len(last.path) == 512
    assert last.detail == "query=b,dry_run" and "secret" not in last.detail


def test_rows_older_than_the_retention_are_deleted(api: Api) -> None:
    assert api.app.ctx.settings.audit_retention_days == 90
    admin = api.login()
    api.client.post("/api/v1/tenants", json={"name": "old"}, headers=admin)
    first = [x.id for x in rows(api)]
    assert len(first) == 2
    api.clock.advance(89 * 86400)
    admin = api.login()  # (tokens live 12 h)
    api.client.post("/api/v1/tenants", json={"name": "newer"}, headers=admin)
    assert len(rows(api)) == 4  # nothing is 90 days old yet
    api.clock.advance(2 * 86400)  # the first two rows are now 91 days old
    admin = api.login()
    api.client.post("/api/v1/tenants", json={"name": "newest"}, headers=admin)
    left = rows(api)
    assert len(left) == 4 and not {x.id for x in left} & set(first)
    assert all(api.clock.now() - x.created_at < timedelta(days=90) for x in left)
