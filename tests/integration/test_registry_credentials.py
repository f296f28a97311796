"""Registry credentials (H7): who manages which, the password sealed at rest and never
shown, validation naming the field, and the claim handing the pull's login to the
claiming agent only — on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.db.tables import AuditRecord, Event, RegistryCredential
from heteroflow.services.tenancy.registry_credentials import Sealer

from .conftest import Api, service_body

pytestmark = pytest.mark.feature("H7")

CREDS = "/api/v1/registry-credentials"
PASSWORD = "s3cret-registry-pass"
OTHER_PASSWORD = "another-registry-pass"


def user(api: Api, admin: dict[str, str], tenant: str, name: str, role: str) -> dict[str, Any]:
    t = api.client.post("/api/v1/tenants", json={"name": tenant}, headers=admin)
    tenant_id = t.json()["id"] if t.status_code == 201 else next(
        x["id"] for x in api.client.get("/api/v1/tenants", headers=admin).json()
        if x["name"] == tenant
    )
    u = api.client.post(
        "/api/v1/users",
        json={"username": name, "password": "member-pass-1", "tenant_id": tenant_id, "role": role},
        headers=admin,
    )
    assert u.status_code == 201, u.text
    return {"headers": api.login(name, "member-pass-1"), "tenant_id": tenant_id}


def create(api: Api, headers: dict[str, str], **body: Any) -> Any:
    return api.client.post(
        CREDS,
        json={"registry_host": "registry.example.com:5000", "username": "puller",
              "password": PASSWORD, **body},
        headers=headers,
    )


def test_operator_manages_credentials_and_never_sees_a_password(api: Api) -> None:
    admin = api.login()
    r = create(api, admin)
    assert r.status_code == 201, r.text
    cred = r.json()
    assert cred["id"].startswith("rc-") and cred["tenant_id"] == ""  # the platform's
    assert (cred["registry_host"], cred["username"]) == ("registry.example.com:5000", "puller")
    assert set(cred) == {"id", "tenant_id", "registry_host", "username", "created_by",
                         "created_at", "updated_at"}
    listed = api.client.get(CREDS, headers=admin)
    assert listed.json() == [cred]
    changed = api.client.patch(f"{CREDS}/{cred['id']}", json={"password": OTHER_PASSWORD},
                               headers=admin)
    assert changed.status_code == 200 and changed.json()["username"] == "puller"
    shown = api.client.get(f"{CREDS}/{cred['id']}", headers=admin)
    for answer in (r, listed, changed, shown, api.client.get("/api/v1/openapi.json")):
        assert PASSWORD not in answer.text and OTHER_PASSWORD not in answer.text
    assert api.client.delete(f"{CREDS}/{cred['id']}", headers=admin).status_code == 204
    assert api.client.get(f"{CREDS}/{cred['id']}", headers=admin).status_code == 404
    # the writes are audited (who, what), never with their bodies
    with api.app.db.session() as s:
        audited = list(s.scalars(select(AuditRecord).where(AuditRecord.path.like(f"{CREDS}%"))))
        assert [(a.method, a.status) for a in audited] == [
            ("POST", 201), ("PATCH", 200), ("DELETE", 204),
        ]
        rows = [str(getattr(a, c.name)) for a in audited for c in AuditRecord.__table__.columns]
        assert not any(PASSWORD in v or OTHER_PASSWORD in v for v in rows)


def test_the_password_is_sealed_at_rest_for_its_own_row(api: Api) -> None:
    admin = api.login()
    cred = create(api, admin).json()
    with api.app.db.session() as s:
        row = s.get(RegistryCredential, cred["id"])
        assert row is not None
        assert PASSWORD not in row.password_sealed and row.password_sealed.startswith("v1.")
        sealer: Sealer = api.app.sealer
        assert sealer.open(row.password_sealed, row.id) == PASSWORD
        with pytest.raises(ValueError, match="another"):
            sealer.open(row.password_sealed, "rc-000000000000")  # moved to another row
        with pytest.raises(ValueError, match="another"):
            Sealer("some other platform secret").open(row.password_sealed, row.id)


def test_tenant_admins_manage_their_own_tenant_only_and_members_none(api: Api) -> None:
    admin = api.login()
    ta = user(api, admin, "team-a", "ta-admin", "tenant_admin")
    tb = user(api, admin, "team-b", "tb-admin", "tenant_admin")
    member = user(api, admin, "team-a", "ta-member", "member")
    platform = create(api, admin).json()
    own = create(api, ta["headers"])
    assert own.status_code == 201, own.text
    assert own.json()["tenant_id"] == ta["tenant_id"]
    # another tenant's, or the platform's: refused, naming the field
    for asked in (tb["tenant_id"], ""):
        r = create(api, ta["headers"], tenant_id=asked)
        assert r.status_code == 403 and r.json()["error"]["field"] == "tenant_id", r.text
    # each tenant admin lists its own; another tenant's and the platform's answer 404
    assert [c["id"] for c in api.client.get(CREDS, headers=ta["headers"]).json()] == [
        own.json()["id"]
    ]
    assert api.client.get(CREDS, headers=tb["headers"]).json() == []
    for cid in (own.json()["id"], platform["id"]):
        assert api.client.get(f"{CREDS}/{cid}", headers=tb["headers"]).status_code == 404
        assert api.client.delete(f"{CREDS}/{cid}", headers=tb["headers"]).status_code == 404
    assert api.client.get(f"{CREDS}/{platform['id']}", headers=ta["headers"]).status_code == 404
    # a member: none at all
    assert api.client.get(CREDS, headers=member["headers"]).status_code == 403
    assert create(api, member["headers"]).status_code == 403
    r = api.client.patch(f"{CREDS}/{own.json()['id']}", json={"username": "x"},
                         headers=member["headers"])
    assert r.status_code == 403
    # the operator sees them all, and sets one for a tenant
    assert len(api.client.get(CREDS, headers=admin).json()) == 2
    r = create(api, admin, tenant_id=tb["tenant_id"])
    assert r.status_code == 201 and r.json()["tenant_id"] == tb["tenant_id"]
    r = create(api, admin, tenant_id="tn-000000000000")
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"registry_host": "https://registry.example.com"}, "registry_host"),
        ({"registry_host": "registry.example.com/path"}, "registry_host"),
        ({"registry_host": ""}, "registry_host"),
        ({"username": "a:b"}, "username"),
        ({"username": ""}, "username"),
        ({"password": "short"}, "password"),
        ({"password": 12345678}, "password"),
        ({"password": "x\u0000yyyyyy"}, "password"),
        ({"tenant_id": "a b"}, "tenant_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_input_names_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    admin = api.login()
    r = create(api, admin, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    assert PASSWORD not in r.text


def test_one_credential_per_tenant_and_registry(api: Api) -> None:
    admin = api.login()
    assert create(api, admin).status_code == 201
    again = create(api, admin, registry_host="REGISTRY.example.com:5000")  # same host
    assert again.status_code == 409 and again.json()["error"]["field"] == "registry_host"
    assert create(api, admin, registry_host="registry.example.com").status_code == 201
    hub = create(api, admin, registry_host="index.docker.io")  # Docker Hub's names: one key
    assert hub.status_code == 201 and hub.json()["registry_host"] == "docker.io"
    assert create(api, admin, registry_host="docker.io").status_code == 409
    r = api.client.patch(f"{CREDS}/{hub.json()['id']}", json={}, headers=admin)
    assert r.status_code == 400


def claim(api: Api, headers: dict[str, str], image: str, name: str) -> dict[str, Any]:
    node_id = api.heartbeat()
    g = api.client.post(
        "/api/v1/task-groups",
        json=service_body(name=name, task={"image": image, "engine": "llamacpp"}),
        headers=headers,
    )
    assert g.status_code == 201, g.text
    task_id = str(g.json()["tasks"][0]["id"])
    api.app.scheduler.run_round()
    beat = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "inventory": {"cpu_count": 4, "memory_total_mb": 16384,
                            "memory_available_mb": 16384}},
        headers={"Authorization": "Bearer node-token-for-tests"},
    )
    assert PASSWORD not in beat.text and OTHER_PASSWORD not in beat.text  # heartbeat: never
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_the_claim_carries_the_tenants_login_else_the_platforms(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    admin = api.login()
    ta = user(api, admin, "team-a", "ta-admin", "tenant_admin")
    tb = user(api, admin, "team-b", "tb-admin", "tenant_admin")
    assert create(api, admin, password=PASSWORD).status_code == 201  # the platform's
    mine = create(api, ta["headers"], username="team-a-bot", password=OTHER_PASSWORD)
    assert mine.status_code == 201
    image = "registry.example.com:5000/team/engine:v1"
    a = claim(api, ta["headers"], image, "svc-a")
    assert a["registry_auth"] == {"username": "team-a-bot", "password": OTHER_PASSWORD}
    b = claim(api, tb["headers"], image, "svc-b")  # no own credential: the platform's
    assert b["registry_auth"] == {"username": "puller", "password": PASSWORD}
    hub = claim(api, ta["headers"], "ghcr.io/ggml-org/llama.cpp:server", "svc-c")
    assert hub["registry_auth"] is None  # no credential for that registry
    # never in the task's events, the group's read, or a log line
    with api.app.db.session() as s:
        texts = [e.message for e in s.scalars(select(Event))]
    assert not any(PASSWORD in t or OTHER_PASSWORD in t for t in texts)
    groups = api.client.get("/api/v1/task-groups", headers=admin).text
    assert PASSWORD not in groups and OTHER_PASSWORD not in groups
    assert PASSWORD not in caplog.text and OTHER_PASSWORD not in caplog.text


def test_a_credential_sealed_under_another_secret_does_not_fail_the_claim(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    admin = api.login()
    cred = create(api, admin).json()
    with api.app.db.session() as s:  # as if restored beside another platform secret
        row = s.get(RegistryCredential, cred["id"])
        assert row is not None
        row.password_sealed = Sealer("another platform secret").seal(PASSWORD, row.id)
    claimed = claim(api, admin, "registry.example.com:5000/team/engine:v1", "svc-x")
    assert claimed["status"] == "starting" and claimed["registry_auth"] is None
    assert f"registry credential {cred['id']}" in caplog.text and PASSWORD not in caplog.text
