"""Sharing groups of tenants (N3): the operator API, tenant fields and the share keys."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from heteroflow.core.errors import Conflict
from heteroflow.schemas.sharing import SharingGroupTenantAdd
from heteroflow.services.identity.auth import Principal
from heteroflow.services.tenancy import sharing
from heteroflow.services.tenancy.sharing import tenant_share_keys

from .conftest import Api

pytestmark = pytest.mark.feature("N3")

GROUPS = "/api/v1/sharing-groups"


def tenant(api: Api, admin: dict[str, str], name: str, **fields: Any) -> dict[str, Any]:
    r = api.client.post("/api/v1/tenants", json={"name": name, **fields}, headers=admin)
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def group(api: Api, admin: dict[str, str], name: str) -> dict[str, Any]:
    r = api.client.post(GROUPS, json={"name": name}, headers=admin)
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def tenant_read(api: Api, admin: dict[str, str], tenant_id: str) -> dict[str, Any]:
    rows = api.client.get("/api/v1/tenants", headers=admin).json()
    return next(t for t in rows if t["id"] == tenant_id)


def test_operator_creates_lists_shows_and_deletes_a_group(api: Api) -> None:
    admin = api.login()
    g = group(api, admin, "research")
    assert g["id"].startswith("sg-") and g["name"] == "research" and g["tenants"] == []
    group(api, admin, "apps")
    listed = api.client.get(GROUPS, headers=admin).json()
    assert [x["name"] for x in listed] == ["apps", "research"]
    assert api.client.get(f"{GROUPS}/{g['id']}", headers=admin).json() == g
    assert api.client.delete(f"{GROUPS}/{g['id']}", headers=admin).status_code == 204
    r = api.client.get(f"{GROUPS}/{g['id']}", headers=admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert api.client.delete(f"{GROUPS}/{g['id']}", headers=admin).status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [({"name": "has space"}, "name"), ({"name": ""}, "name"), ({"name": "x", "extra": 1}, "extra")],
)
def test_bad_group_body_is_400_naming_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    r = api.client.post(GROUPS, json=body, headers=api.login())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field


def test_duplicate_group_name_is_409(api: Api) -> None:
    admin = api.login()
    group(api, admin, "shared")
    r = api.client.post(GROUPS, json={"name": "shared"}, headers=admin)
    assert r.status_code == 409 and r.json()["error"]["field"] == "name"
    assert "'shared' already exists" in r.json()["error"]["message"]


def test_members_get_403_on_every_sharing_route_and_on_tenant_changes(api: Api) -> None:
    admin = api.login()
    g = group(api, admin, "ops-only")
    member = api.member(admin, "acme", "alice")
    me = api.client.get("/api/v1/tenants", headers=member).json()[0]
    calls = [
        ("post", GROUPS, {"name": "mine"}),
        ("get", GROUPS, None),
        ("get", f"{GROUPS}/{g['id']}", None),
        ("delete", f"{GROUPS}/{g['id']}", None),
        ("post", f"{GROUPS}/{g['id']}/tenants", {"tenant_id": me["id"]}),
        ("delete", f"{GROUPS}/{g['id']}/tenants/{me['id']}", None),
        ("patch", f"/api/v1/tenants/{me['id']}", {"priority_ceiling": 1000}),
    ]
    for method, path, body in calls:
        kwargs: dict[str, Any] = {"headers": member}
        if body is not None:
            kwargs["json"] = body
        r = api.client.request(method.upper(), path, **kwargs)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["code"] == "forbidden"
    # nothing changed
    assert api.client.get(f"{GROUPS}/{g['id']}", headers=admin).json()["tenants"] == []
    assert tenant_read(api, admin, me["id"])["priority_ceiling"] == 100


def test_add_and_remove_a_tenant(api: Api) -> None:
    admin = api.login()
    g = group(api, admin, "pair")
    a = tenant(api, admin, "alpha")
    assert a["sharing_group_id"] is None and a["priority_ceiling"] == 100
    r = api.client.post(f"{GROUPS}/{g['id']}/tenants", json={"tenant_id": a["id"]}, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["tenants"] == [{"id": a["id"], "name": "alpha"}]
    assert tenant_read(api, admin, a["id"])["sharing_group_id"] == g["id"]
    # adding it again is a no-op, not an error
    again = api.client.post(
        f"{GROUPS}/{g['id']}/tenants", json={"tenant_id": a["id"]}, headers=admin
    )
    assert again.status_code == 200 and again.json() == r.json()

    r = api.client.delete(f"{GROUPS}/{g['id']}/tenants/{a['id']}", headers=admin)
    assert r.status_code == 200 and r.json()["tenants"] == []
    assert tenant_read(api, admin, a["id"])["sharing_group_id"] is None
    r = api.client.delete(f"{GROUPS}/{g['id']}/tenants/{a['id']}", headers=admin)
    assert r.status_code == 404 and "not in sharing group 'pair'" in r.json()["error"]["message"]


def test_a_tenant_is_in_at_most_one_group(api: Api) -> None:
    admin = api.login()
    first, second = group(api, admin, "first"), group(api, admin, "second")
    a = tenant(api, admin, "alpha")
    api.client.post(f"{GROUPS}/{first['id']}/tenants", json={"tenant_id": a["id"]}, headers=admin)
    r = api.client.post(
        f"{GROUPS}/{second['id']}/tenants", json={"tenant_id": a["id"]}, headers=admin
    )
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["field"] == "tenant_id"
    assert "'first'" in err["message"] and first["id"] in err["message"]
    assert tenant_read(api, admin, a["id"])["sharing_group_id"] == first["id"]
    assert api.client.get(f"{GROUPS}/{second['id']}", headers=admin).json()["tenants"] == []


def test_unknown_tenant_or_group_is_404(api: Api) -> None:
    admin = api.login()
    g = group(api, admin, "g")
    a = tenant(api, admin, "alpha")
    r = api.client.post(f"{GROUPS}/{g['id']}/tenants", json={"tenant_id": "tn-0"}, headers=admin)
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id"
    r = api.client.post(f"{GROUPS}/sg-0/tenants", json={"tenant_id": a["id"]}, headers=admin)
    assert r.status_code == 404
    r = api.client.delete(f"{GROUPS}/{g['id']}/tenants/tn-0", headers=admin)
    assert r.status_code == 404
    r = api.client.post(f"{GROUPS}/{g['id']}/tenants", json={}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "tenant_id"


def test_a_group_with_tenants_is_not_deleted_409_names_them(api: Api) -> None:
    admin = api.login()
    g = group(api, admin, "busy")
    a, b = tenant(api, admin, "alpha"), tenant(api, admin, "beta")
    for t in (a, b):
        api.client.post(f"{GROUPS}/{g['id']}/tenants", json={"tenant_id": t["id"]}, headers=admin)
    r = api.client.delete(f"{GROUPS}/{g['id']}", headers=admin)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert f"alpha ({a['id']})" in message and f"beta ({b['id']})" in message
    assert tenant_read(api, admin, a["id"])["sharing_group_id"] == g["id"]
    for t in (a, b):
        api.client.delete(f"{GROUPS}/{g['id']}/tenants/{t['id']}", headers=admin)
    assert api.client.delete(f"{GROUPS}/{g['id']}", headers=admin).status_code == 204


def test_patch_tenant_moves_between_groups_and_detaches(api: Api) -> None:
    admin = api.login()
    first, second = group(api, admin, "first"), group(api, admin, "second")
    a = tenant(api, admin, "alpha", sharing_group_id=first["id"], priority_ceiling=250)
    assert a["sharing_group_id"] == first["id"] and a["priority_ceiling"] == 250
    path = f"/api/v1/tenants/{a['id']}"
    r = api.client.patch(path, json={"sharing_group_id": second["id"]}, headers=admin)
    assert r.status_code == 200 and r.json()["sharing_group_id"] == second["id"]
    assert r.json()["priority_ceiling"] == 250  # fields left out stay
    assert api.client.get(f"{GROUPS}/{first['id']}", headers=admin).json()["tenants"] == []
    r = api.client.patch(path, json={"sharing_group_id": None}, headers=admin)
    assert r.status_code == 200 and r.json()["sharing_group_id"] is None

    r = api.client.patch(path, json={"sharing_group_id": "sg-000000000000"}, headers=admin)
    assert r.status_code == 404 and r.json()["error"]["field"] == "sharing_group_id"
    r = api.client.post(
        "/api/v1/tenants", json={"name": "beta", "sharing_group_id": "sg-0"}, headers=admin
    )
    assert r.status_code == 404 and r.json()["error"]["field"] == "sharing_group_id"
    r = api.client.patch("/api/v1/tenants/tn-0", json={"priority_ceiling": 5}, headers=admin)
    assert r.status_code == 404


def test_tenant_share_keys_equal_exactly_inside_a_group(api: Api) -> None:
    admin = api.login()
    g = group(api, admin, "pool")
    a = tenant(api, admin, "alpha", sharing_group_id=g["id"])
    b = tenant(api, admin, "beta")
    c = tenant(api, admin, "gamma")
    api.client.post(f"{GROUPS}/{g['id']}/tenants", json={"tenant_id": b["id"]}, headers=admin)
    with api.app.db.session() as s:
        keys = tenant_share_keys(s)
    assert keys[a["id"]] == keys[b["id"]] == g["id"]
    assert keys[c["id"]] == c["id"]
    default = next(t for t in api.client.get("/api/v1/tenants", headers=admin).json()
                   if t["name"] == "default")
    assert keys[default["id"]] == default["id"]
    assert len(set(keys.values())) == 3  # pool, gamma, default

    api.client.delete(f"{GROUPS}/{g['id']}/tenants/{b['id']}", headers=admin)
    with api.app.db.session() as s:
        keys = tenant_share_keys(s)
    assert keys[b["id"]] == b["id"] != keys[a["id"]]


def test_two_operators_joining_one_tenant_to_two_groups_at_once_one_is_refused(api: Api) -> None:
    """The join is a compare-and-set: the second waits for the first's lock, then sees it."""
    admin = api.login()
    first, second = group(api, admin, "first"), group(api, admin, "second")
    a = tenant(api, admin, "alpha")
    op = Principal(user_id="usr-x", username="admin", tenant_id="tn-x", role="operator")
    outcome: dict[str, Exception | None] = {}

    def join_second() -> None:
        try:
            with api.app.db.session() as s2:
                sharing.add_tenant(s2, op, second["id"], SharingGroupTenantAdd(tenant_id=a["id"]))
            outcome["second"] = None
        except Conflict as exc:
            outcome["second"] = exc

    with api.app.db.session() as s1:
        sharing.add_tenant(s1, op, first["id"], SharingGroupTenantAdd(tenant_id=a["id"]))
        racer = threading.Thread(target=join_second)
        racer.start()
        racer.join(timeout=1)
        assert racer.is_alive(), "the second join did not wait for the first one's write"
    racer.join(timeout=30)
    assert isinstance(outcome["second"], Conflict)
    assert "'first'" in outcome["second"].message
    assert tenant_read(api, admin, a["id"])["sharing_group_id"] == first["id"]


class _Borrowed:
    """The CLI's HTTP client, served by the in-process app as the operator."""

    def __init__(self, api: Api, headers: dict[str, str]) -> None:
        self.api, self.headers = api, headers

    def __enter__(self) -> _Borrowed:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.api.client.request(method, path, headers=self.headers, **kwargs)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> Any:
        return self.request("PATCH", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> Any:
        return self.request("DELETE", path, **kwargs)


@pytest.mark.feature("N3", "B2")
def test_cli_manages_groups_and_shows_the_pending_reason(
    api: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from heteroflow import cli
    from heteroflow.cmd import remote

    admin = api.login()
    monkeypatch.setattr(remote, "_client", lambda server=None: _Borrowed(api, admin))

    def run(*argv: str) -> str:
        assert cli.main(list(argv)) == 0
        return capsys.readouterr().out

    g = json.loads(run("sharing-groups", "create", "lab", "--json"))
    t = json.loads(run("tenants", "create", "alpha", "--priority-ceiling", "300", "--json"))
    assert t["priority_ceiling"] == 300
    joined = json.loads(run("sharing-groups", "add-tenant", g["id"], t["id"], "--json"))
    assert joined["tenants"] == [{"id": t["id"], "name": "alpha"}]
    assert [x["name"] for x in json.loads(run("sharing-groups", "list", "--json"))] == ["lab"]
    assert cli.main(["sharing-groups", "delete", g["id"]]) == 1  # refused: one line, exit 1
    refused = capsys.readouterr().err
    assert "error 409" in refused and "alpha" in refused
    moved = json.loads(run("tenants", "update", t["id"], "--sharing-group", "none", "--json"))
    assert moved["sharing_group_id"] is None
    assert run("sharing-groups", "delete", g["id"]).strip() == f"deleted {GROUPS}/{g['id']}"

    # a GPU service with no GPU node stays pending; the CLI prints the scheduler's reason
    out = run(
        "services", "create", "--name", "gpu-svc", "--image", "vllm/vllm-openai:v0.11.2",
        "--model-path", "m", "--gpus", "1", "--no-wait",
    )
    group_id = out.split()[1]
    api.app.scheduler.run_round()
    shown = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()
    reason = shown["tasks"][0]["status_message"]
    assert shown["tasks"][0]["status"] == "pending" and reason.startswith("InsufficientResources")
    printed = run("services", "show", group_id)
    assert f"is pending:\n  {reason.splitlines()[0]}" in printed
