"""Tenant quotas (N2) at every door, on both databases: operators set them (API, with
validation naming the field), members read their usage against them but cannot set
them; a create and its dry run refuse alike past cards, services, replicas or CPU
memory (409 ``quota_exceeded`` naming the quota); a scale-out (by hand, or by a new
lower bound) and a rolling update's surge are refused past it, a scale-in never; the
autoscaler clamps to the quota and its timeline names it."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, service_body
from .test_autoscaler import autoscale, decisions, ids
from .test_rollout import put_update
from .test_scale import backend, create, group, policy, report_load, run_all, scale


def team(api: Api, name: str = "team-a") -> tuple[dict[str, str], dict[str, str], str]:
    """(admin headers, member headers, the member's tenant id)."""
    admin = api.login()
    member = api.member(admin, name, f"{name}-user")
    [tenant] = api.client.get("/api/v1/tenants", headers=member).json()
    return admin, member, str(tenant["id"])


def set_quota(api: Api, headers: dict[str, str], tenant_id: str, **q: Any) -> Any:
    return api.client.patch(f"/api/v1/tenants/{tenant_id}", json=q, headers=headers)


def usage(api: Api, headers: dict[str, str], tenant_id: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/tenants/{tenant_id}/quota", headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def post(api: Api, headers: dict[str, str], dry_run: bool = False, **over: Any) -> Any:
    url = "/api/v1/task-groups" + ("?dry_run=true" if dry_run else "")
    return api.client.post(url, json=service_body(**over), headers=headers)


def refused(r: Any, field: str) -> str:
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == ("quota_exceeded", field), err
    return str(err["message"])


@pytest.mark.feature("N2")
def test_operators_set_quotas_members_read_their_usage_but_cannot_set_them(api: Api) -> None:
    admin, member, tid = team(api)
    r = set_quota(api, admin, tid, quota_cards=4, quota_services=3, quota_replicas=6,
                  quota_cpu_memory_mb=8192)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["quota_cards"], got["quota_services"], got["quota_replicas"],
            got["quota_cpu_memory_mb"]) == (4, 3, 6, 8192)
    # what a member holds: half a card, one CPU replica of 2048 MB
    assert post(api, member, name="gpu", task={"gpu_required": 1},
                gpu_memory_utilization=50).status_code == 201
    assert post(api, member, name="cpu", task={"memory_mb": 2048}).status_code == 201
    q = usage(api, member, tid)
    assert q["limits"] == {"cards": 4, "services": 3, "replicas": 6, "cpu_memory_mb": 8192}
    assert q["usage"] == {"cards": 0.5, "services": 2, "replicas": 2, "cpu_memory_mb": 2048}
    assert q["tenant_name"] == "team-a"

    # members read, never set; another tenant's quota is not theirs to see
    r = set_quota(api, member, tid, quota_cards=100)
    assert r.status_code == 403, r.text
    _, other, other_tid = team(api, "team-b")
    assert api.client.get(f"/api/v1/tenants/{tid}/quota", headers=other).status_code == 404
    assert usage(api, admin, other_tid)["usage"]["services"] == 0

    # validation names the field; null or 0 lifts a limit
    for bad, value in (("quota_cards", -1), ("quota_services", 10**9),
                       ("quota_cpu_memory_mb", 2**31), ("quota_replicas", "many")):
        r = set_quota(api, admin, tid, **{bad: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == bad
    r = set_quota(api, admin, tid, quota_cards=None, quota_services=0)
    assert r.status_code == 200 and (r.json()["quota_cards"], r.json()["quota_services"]) == (0, 0)
    assert r.json()["quota_replicas"] == 6  # left out: kept


@pytest.mark.feature("N2", "A6")
def test_a_create_and_its_dry_run_refuse_alike_past_each_quota(api: Api) -> None:
    admin, member, tid = team(api)
    assert set_quota(api, admin, tid, quota_cards=2).status_code == 200
    assert post(api, member, name="half", task={"gpu_required": 1},
                gpu_memory_utilization=50).status_code == 201
    # two whole cards beside half a card: 2.5 > 2
    big: dict[str, Any] = {"name": "big", "task": {"gpu_required": 2}}
    dry, real = post(api, member, dry_run=True, **big), post(api, member, **big)
    assert dry.json() == real.json()  # one decision, one answer
    message = refused(real, "quota_cards")
    assert message.startswith(
        "tenant 'team-a' quota: 2 cards, 0.5 in use, this service (1 replica(s)) needs 2"
    )
    # what fits passes, dry run included: 0.5 + 1.5 (3 replicas at 50%) = 2
    fits: dict[str, Any] = {"name": "fits", "parallelism": "split", "world_size": 3,
            "gpu_memory_utilization": 50, "task": {"gpu_required": 1}}
    assert post(api, member, dry_run=True, **fits).status_code == 200
    assert post(api, member, **fits).status_code == 201
    assert usage(api, member, tid)["usage"]["cards"] == 2
    # a CPU service needs no card
    assert post(api, member, name="cpu").status_code == 201

    # services, replicas, CPU memory
    assert set_quota(api, admin, tid, quota_cards=0, quota_services=3).status_code == 200
    refused(post(api, member, name="fourth"), "quota_services")
    assert api.client.delete(
        f"/api/v1/task-groups/{real_id(api, member, 'cpu')}", headers=member
    ).status_code in (200, 202, 204)
    assert post(api, member, dry_run=True, name="fourth").status_code == 200  # freed
    assert set_quota(api, admin, tid, quota_services=0, quota_replicas=5).status_code == 200
    two: dict[str, Any] = {"parallelism": "split", "world_size": 2}
    message = refused(post(api, member, name="pair", **two), "quota_replicas")
    assert "5 replicas, 4 in use, this service (2 replica(s)) needs 2" in message
    assert set_quota(api, admin, tid, quota_replicas=0,
                     quota_cpu_memory_mb=3000).status_code == 200
    assert post(api, member, name="c1", task={"memory_mb": 2000}).status_code == 201
    message = refused(post(api, member, dry_run=True, name="c2"), "quota_cpu_memory_mb")
    assert "3000 MB of CPU memory, 2000 in use, this service (1 replica(s)) needs 1024" in message
    # another tenant is not limited by team-a's quota
    _, other, _ = team(api, "team-b")
    assert post(api, other, name="c2", task={"memory_mb": 4096}).status_code == 201


def real_id(api: Api, headers: dict[str, str], name: str) -> str:
    groups = api.client.get("/api/v1/task-groups", headers=headers).json()
    [g] = [g for g in groups if g["name"] == name]
    return str(g["id"])


@pytest.mark.feature("N2")
def test_a_scale_out_past_the_quota_is_refused_a_scale_in_never(api: Api) -> None:
    admin, member, tid = team(api)
    node = api.heartbeat()
    gid = create(api, member, max_replicas=4)["id"]
    run_all(api, node, member, gid)
    assert set_quota(api, admin, tid, quota_replicas=2).status_code == 200
    assert scale(api, member, gid, 2).status_code == 200
    message = refused(scale(api, member, gid, 4), "quota_replicas")
    assert "2 replicas, 2 in use, scaling 'svc' from 2 to 4 replica(s) needs 2" in message
    assert group(api, member, gid)["current_replicas"] == 2  # nothing moved
    # a new lower bound that would scale it out asks the quota too
    refused(policy(api, member, gid, enabled=False, min_replicas=3), "quota_replicas")
    # a quota lowered below what runs refuses growth only
    assert set_quota(api, admin, tid, quota_replicas=1).status_code == 200
    assert scale(api, member, gid, 1).status_code == 200
    assert usage(api, member, tid)["usage"]["replicas"] == 1


@pytest.mark.feature("N2")
def test_a_rolling_updates_surge_counts_against_the_quota(api: Api) -> None:
    admin, member, tid = team(api)
    node = api.heartbeat()
    gid = create(api, member, parallelism="split", world_size=2)["id"]
    run_all(api, node, member, gid)
    assert set_quota(api, admin, tid, quota_replicas=2).status_code == 200
    code, body = put_update(api, member, gid, image="ghcr.io/ggml-org/llama.cpp:server-b2")
    assert code == 409, body
    assert body["error"]["field"] == "quota_replicas"
    assert "a rolling update in batches of 1" in body["error"]["message"]
    # recreate has no surge
    code, body = put_update(api, member, gid, image="ghcr.io/ggml-org/llama.cpp:server-b2",
                            strategy="recreate")
    assert code == 200, body


@pytest.mark.feature("N2")
def test_the_autoscaler_clamps_to_the_quota_and_says_so(api: Api) -> None:
    admin, member, tid = team(api)
    node = api.heartbeat()
    gid = create(api, member,
                 scale_policy={"metric": "inflight", "target": 2, "max_replicas": 4})["id"]
    run_all(api, node, member, gid)
    assert set_quota(api, admin, tid, quota_replicas=2).status_code == 200
    [t0] = ids(api, member, gid)
    # 9 in flight, target 2: ceil(9 / 2) = 5, clamped to max 4, then to the quota's 2
    report_load(api, [backend(t0, gid, 9)])
    out = autoscale(api)[gid]
    assert out.decision is not None and (out.decision.raw, out.decision.desired) == (5, 2)
    assert out.scaled is not None and len(out.scaled.added) == 1
    [event] = decisions(api, member, gid)
    assert (event["from_status"], event["to_status"]) == ("1", "2:clamped:quota-clamped")
    assert "quota-clamped to 2: tenant 'team-a' quota: 2 replicas, 1 in use" in event["message"]
    assert "(quota_replicas)" in event["message"]
    # at the quota: it stays, said once
    run_all(api, node, member, gid)
    report_load(api, [backend(t, gid, 9) for t in ids(api, member, gid)])
    autoscale(api)
    autoscale(api)
    assert [e["to_status"] for e in decisions(api, member, gid)] == [
        "2:clamped:quota-clamped", "2:clamped:quota-clamped",
    ]
    assert group(api, member, gid)["current_replicas"] == 2
    assert usage(api, member, tid)["usage"]["replicas"] == 2
