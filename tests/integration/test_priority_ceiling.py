"""B4: members set a group's priority up to their tenant's ceiling; operators 0-1000."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, service_body

GROUPS = "/api/v1/task-groups"


def my_tenant_id(api: Api, member: dict[str, str]) -> str:
    return str(api.client.get("/api/v1/tenants", headers=member).json()[0]["id"])


def test_member_priority_is_capped_by_the_default_ceiling(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "acme", "alice")
    ok = api.client.post(GROUPS, json=service_body(name="at", priority=100), headers=member)
    assert ok.status_code == 201, ok.text
    assert ok.json()["priority"] == 100 and ok.json()["tasks"][0]["id"]

    r = api.client.post(GROUPS, json=service_body(name="above", priority=101), headers=member)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == "priority" and "ceiling of 100" in err["message"]
    # the dry run is the same plan: it refuses too, and nothing was written
    r = api.client.post(
        f"{GROUPS}?dry_run=true", json=service_body(name="above", priority=101), headers=member
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "priority"
    names = [g["name"] for g in api.client.get(GROUPS, headers=member).json()]
    assert names == ["at"]


def test_operator_raises_and_lowers_the_ceiling(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "acme", "alice")
    path = f"/api/v1/tenants/{my_tenant_id(api, member)}"
    r = api.client.patch(path, json={"priority_ceiling": 500}, headers=admin)
    assert r.status_code == 200 and r.json()["priority_ceiling"] == 500
    # members see their own ceiling
    assert api.client.get("/api/v1/tenants", headers=member).json()[0]["priority_ceiling"] == 500
    r = api.client.post(GROUPS, json=service_body(name="high", priority=500), headers=member)
    assert r.status_code == 201, r.text
    r = api.client.post(GROUPS, json=service_body(name="higher", priority=501), headers=member)
    assert r.status_code == 400 and "ceiling of 500" in r.json()["error"]["message"]

    assert api.client.patch(path, json={"priority_ceiling": 0}, headers=admin).status_code == 200
    r = api.client.post(GROUPS, json=service_body(name="one", priority=1), headers=member)
    assert r.status_code == 400 and "use 0-0" in r.json()["error"]["message"]
    r = api.client.post(GROUPS, json=service_body(name="zero"), headers=member)
    assert r.status_code == 201 and r.json()["priority"] == 0


def test_operators_set_any_priority_0_to_1000(api: Api) -> None:
    admin = api.login()
    r = api.client.post(GROUPS, json=service_body(name="top", priority=1000), headers=admin)
    assert r.status_code == 201 and r.json()["priority"] == 1000
    assert r.json()["tasks"][0]["status"] == "pending"
    for bad in (1001, -1):
        r = api.client.post(GROUPS, json=service_body(name="bad", priority=bad), headers=admin)
        assert r.status_code == 400 and r.json()["error"]["field"] == "priority"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"priority_ceiling": 1001}, "priority_ceiling"),
        ({"priority_ceiling": -1}, "priority_ceiling"),
        ({"priority_ceiling": None}, "priority_ceiling"),
        ({"priority_ceiling": "high"}, "priority_ceiling"),
        ({"name": "renamed"}, "name"),
    ],
)
def test_bad_tenant_update_is_400_naming_the_field(
    api: Api, body: dict[str, Any], field: str
) -> None:
    admin = api.login()
    member = api.member(admin, "acme", "alice")
    r = api.client.patch(f"/api/v1/tenants/{my_tenant_id(api, member)}", json=body, headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field


def test_ceiling_at_tenant_creation(api: Api) -> None:
    admin = api.login()
    r = api.client.post(
        "/api/v1/tenants", json={"name": "vip", "priority_ceiling": 900}, headers=admin
    )
    assert r.status_code == 201 and r.json()["priority_ceiling"] == 900
    r = api.client.post(
        "/api/v1/tenants", json={"name": "bad", "priority_ceiling": 2000}, headers=admin
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "priority_ceiling"
