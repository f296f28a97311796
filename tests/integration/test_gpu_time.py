"""GPU time beside tokens (N4) through the real API on SQLite and PostgreSQL: services
driven through their states by the scheduler, the agent protocol (claim, report) and the
sleep/wake/delete routes, with the fake clock advanced by hand; the usage report summed,
grouped, clipped and exported against hand-computed traces.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.db.tables import GpuTimeSegment

from .conftest import Api, service_body

A10 = {"vendor": "nvidia", "model": "A10", "memory_total_mb": 24576}
GW = {"Authorization": "Bearer gw-token-for-tests"}
GPU = ("gpu_running_card_seconds", "gpu_sleeping_card_seconds",
       "running_task_seconds", "sleeping_task_seconds")
DAY1 = datetime(2026, 1, 1, tzinfo=UTC)  # the fake clock's start


def cards(n: int) -> list[dict[str, Any]]:
    return [{"index": i, **A10} for i in range(n)]


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def create(api: Api, who: dict[str, str], **over: Any) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups", json=service_body(**over), headers=who)
    assert r.status_code == 201, r.text
    return dict(r.json())


def agent(api: Api, node_id: str, task_id: str, status: str | None) -> None:
    """Claim (status None) or report as the node's agent."""
    if status is None:
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {})
    else:
        body = {"status": status}
        r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", body)
    assert r.status_code == 200, r.text


def post(api: Api, who: dict[str, str], path: str) -> None:
    r = api.client.post(path, headers=who)
    assert r.status_code in (200, 202), r.text


def usage(api: Api, who: dict[str, str], query: str) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/usage?gpu=true&{query}", headers=who)
    assert r.status_code == 200, r.text
    return dict(r.json())


def gpu(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[f] for f in GPU)


def segments(api: Api) -> list[tuple[str, str, int, datetime, datetime | None]]:
    with api.app.db.session() as s:
        q = select(GpuTimeSegment).order_by(GpuTimeSegment.id)
        return [(g.task_id, g.state, g.card_pct, g.started_at, g.ended_at) for g in s.scalars(q)]


def user_id(api: Api, admin: dict[str, str], username: str) -> str:
    users = api.client.get("/api/v1/users", headers=admin).json()
    return str(next(u["id"] for u in users if u["username"] == username))


@pytest.mark.feature("N4")
def test_a_service_through_its_states_by_tenant_member_service_hour_and_day(api: Api) -> None:
    """One card at 50 %: running (from placement) 22:30 -> 00:30 across midnight,
    asleep 00:30 -> 01:00, woken and running to now (01:10)."""
    api.clock.advance(22.5 * 3600)
    t0 = api.clock.now()
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    node = api.heartbeat("gpu-node", gpus=cards(1))
    g = create(api, alice, name="chat", gpu_memory_utilization=50, task={"gpu_required": 1})
    task_id = g["tasks"][0]["id"]
    assert api.app.scheduler.run_round().placed == 1  # scheduled: the card is booked
    agent(api, node, task_id, None)  # starting
    agent(api, node, task_id, "running")
    api.clock.advance(2 * 3600)
    post(api, alice, f"/api/v1/tasks/{task_id}/sleep")
    api.clock.advance(1800)
    api.heartbeat("gpu-node", gpus=cards(1))  # the node is still there
    post(api, alice, f"/api/v1/tasks/{task_id}/wake")  # waking: awake again
    agent(api, node, task_id, "running")
    api.clock.advance(600)
    # scheduled -> starting -> running is one segment; each change of bucket closes one
    woke = t0 + timedelta(hours=2, minutes=30)
    assert segments(api) == [
        (task_id, "running", 50, t0, t0 + timedelta(hours=2)),
        (task_id, "sleeping", 50, t0 + timedelta(hours=2), woke),
        (task_id, "running", 50, woke, None),
    ]
    # tokens recorded at 23:15 on the service's key
    rec = {"endpoint_id": g["endpoint"], "tenant_id": g["tenant_id"], "model": "chat",
           "requests": 5, "prompt_tokens": 50, "completion_tokens": 5,
           "recorded_at": iso(t0 + timedelta(minutes=45))}
    assert api.client.post("/api/v1/gateway/usage", json={"records": [rec]},
                           headers=GW).status_code == 200

    whole = (3900.0, 900.0, 7800.0, 1800.0)  # 0.5 x (7200 + 600), 0.5 x 1800; seconds
    alice_id = user_id(api, admin, "alice")
    rows = usage(api, alice, "group_by=tenant,member,service,model")["rows"]
    assert [(r["tenant_id"], r["member_id"], r["service_id"], r["model"], r["requests"],
             gpu(r)) for r in rows] == [(g["tenant_id"], alice_id, g["id"], "chat", 5, whole)]
    report = usage(api, admin, "group_by=tenant")
    assert [(r["tenant_id"], gpu(r)) for r in report["rows"]] == [(g["tenant_id"], whole)]
    assert gpu(report["total"]) == whole and report["total"]["requests"] == 5

    by_hour = usage(api, alice, f"group_by=service,hour&start={iso(t0)}")["rows"]
    assert [(r["hour"], r["requests"], gpu(r)) for r in by_hour] == [
        ("2026-01-01T22:00:00Z", 0, (900.0, 0.0, 1800.0, 0.0)),
        ("2026-01-01T23:00:00Z", 5, (1800.0, 0.0, 3600.0, 0.0)),
        ("2026-01-02T00:00:00Z", 0, (900.0, 900.0, 1800.0, 1800.0)),
        ("2026-01-02T01:00:00Z", 0, (300.0, 0.0, 600.0, 0.0)),
    ]
    assert all(r["service_id"] == g["id"] for r in by_hour)
    by_day = usage(api, alice, f"group_by=day&start={iso(DAY1)}")["rows"]
    assert [(r["day"], r["requests"], gpu(r)) for r in by_day] == [
        ("2026-01-01", 5, (2700.0, 0.0, 5400.0, 0.0)),
        ("2026-01-02", 0, (1200.0, 900.0, 2400.0, 1800.0)),
    ]
    # [23:00, 00:45) clips the first running segment and the sleep
    clipped = usage(api, alice, f"group_by=&start={iso(DAY1 + timedelta(hours=23))}"
                                f"&end={iso(DAY1 + timedelta(hours=24, minutes=45))}")
    assert gpu(clipped["total"]) == (2700.0, 450.0, 5400.0, 900.0)
    assert clipped["total"]["requests"] == 5
    # the open segment counts up to now, not to an end in the future
    later = usage(api, alice, f"group_by=&end={iso(DAY1 + timedelta(days=9))}")
    assert gpu(later["total"]) == whole
    # GPU time has no endpoint: null in rows grouped by one, the total still has it
    by_ep = usage(api, alice, "group_by=endpoint")
    assert [(r["endpoint_id"], r["requests"], gpu(r)) for r in by_ep["rows"]] == [
        (g["endpoint"], 5, (None,) * 4)
    ]
    assert gpu(by_ep["total"]) == whole
    assert gpu(usage(api, alice, f"endpoint_id={g['endpoint']}")["total"]) == (None,) * 4
    # filters: service, model, member
    assert gpu(usage(api, admin, f"service_id={g['id']}&group_by=")["total"]) == whole
    assert gpu(usage(api, admin, "model=other&group_by=")["total"]) == (0.0,) * 4
    assert gpu(usage(api, admin, f"member_id={alice_id}&group_by=")["total"]) == whole
    # time passes: the open segment grows, the closed ones do not
    api.clock.advance(600)
    assert gpu(usage(api, alice, "group_by=")["total"]) == (4200.0, 900.0, 8400.0, 1800.0)


@pytest.mark.feature("N4")
def test_tensor_parallel_counts_its_cards_and_members_see_their_tenant(api: Api) -> None:
    """Alice: one card at 50 % for 2 h 30 min. Bob: tensor-parallel on 2 cards, 1 h,
    then deleted — the cards count until his agent confirms the stop (30 min later)."""
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    bob = api.member(admin, "team-b", "bob")
    node = api.heartbeat("gpu-node", gpus=cards(4))
    a = create(api, alice, name="half", gpu_memory_utilization=50, task={"gpu_required": 1})
    b = create(api, bob, name="tp", parallelism="tensor_parallel", world_size=2,
               task={"gpu_required": 2})
    assert api.app.scheduler.run_round().placed == 2
    for g in (a, b):
        agent(api, node, g["tasks"][0]["id"], None)
        agent(api, node, g["tasks"][0]["id"], "running")
    api.clock.advance(3600)
    r = api.client.delete(f"/api/v1/task-groups/{b['id']}", headers=bob)
    assert r.status_code == 204, r.text
    api.clock.advance(1800)
    agent(api, node, b["tasks"][0]["id"], "stopped")
    api.clock.advance(3600)  # bob's segment is closed: it stops growing

    by_tenant = usage(api, admin, "group_by=tenant")["rows"]
    assert {r["tenant_id"]: gpu(r) for r in by_tenant} == {
        a["tenant_id"]: (4500.0, 0.0, 9000.0, 0.0),  # 0.5 card x 2.5 h
        b["tenant_id"]: (10800.0, 0.0, 5400.0, 0.0),  # 2 cards x 1.5 h
    }
    # a member sees their own tenant only
    mine = usage(api, bob, "group_by=tenant,service")
    assert [(r["tenant_id"], r["service_id"], gpu(r)) for r in mine["rows"]] == [
        (b["tenant_id"], b["id"], (10800.0, 0.0, 5400.0, 0.0))
    ]
    assert gpu(mine["total"]) == (10800.0, 0.0, 5400.0, 0.0)
    r = api.client.get(f"/api/v1/usage?gpu=true&tenant_id={a['tenant_id']}", headers=bob)
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id"
    by_model = usage(api, admin, "group_by=model")["rows"]
    assert {r["model"]: r["gpu_running_card_seconds"] for r in by_model} == {
        "half": 4500.0, "tp": 10800.0,
    }


@pytest.mark.feature("N5")
def test_a_member_who_sees_only_their_own_gets_their_own_usage(api: Api) -> None:
    """With ``members_see_own``, m1's report holds m1's keys' tokens and m1's tasks'
    GPU time only; m2's answers 404, as elsewhere."""
    admin = api.login()
    m1 = api.member(admin, "team", "m1")
    tenant_id = api.client.get("/api/v1/tenants", headers=m1).json()[0]["id"]
    r = api.client.post("/api/v1/users", headers=admin, json={
        "username": "m2", "password": "member-pass-1", "tenant_id": tenant_id})
    assert r.status_code == 201, r.text
    m2 = api.login("m2", "member-pass-1")
    api.heartbeat("gpu-node", gpus=cards(2))
    mine = create(api, m1, name="one", gpu_memory_utilization=50, task={"gpu_required": 1})
    theirs = create(api, m2, name="two", gpu_memory_utilization=50, task={"gpu_required": 1})
    assert api.app.scheduler.run_round().placed == 2
    api.clock.advance(3600)
    recs = [{"endpoint_id": g["endpoint"], "tenant_id": tenant_id, "model": g["name"],
             "requests": n, "prompt_tokens": n, "completion_tokens": n,
             "recorded_at": iso(DAY1)} for g, n in ((mine, 1), (theirs, 10))]
    api.client.post("/api/v1/gateway/usage", json={"records": recs}, headers=GW)
    r = api.client.patch(f"/api/v1/tenants/{tenant_id}", json={"members_see_own": True},
                         headers=admin)
    assert r.status_code == 200, r.text

    m1_id, m2_id = user_id(api, admin, "m1"), user_id(api, admin, "m2")
    rows = usage(api, m1, "group_by=member,service")["rows"]
    assert [(r["member_id"], r["service_id"], r["requests"], r["gpu_running_card_seconds"])
            for r in rows] == [(m1_id, mine["id"], 1, 1800.0)]
    assert usage(api, m1, "group_by=")["total"]["requests"] == 1
    r = api.client.get(f"/api/v1/usage?member_id={m2_id}", headers=m1)
    assert r.status_code == 404 and r.json()["error"]["field"] == "member_id"
    # the operator sees both
    both = usage(api, admin, "group_by=member")["rows"]
    assert {r["member_id"]: r["requests"] for r in both} == {m1_id: 1, m2_id: 10}


@pytest.mark.feature("N4")
def test_csv_export_has_the_same_rows(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat("gpu-node", gpus=cards(1))
    g = create(api, admin, name="cmd", gpu_memory_utilization=40, task={"gpu_required": 1})
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    agent(api, node, task_id, None)
    agent(api, node, task_id, "running")
    api.clock.advance(1000)
    # tokens under a model name a spreadsheet would run as a formula
    rec = {"endpoint_id": g["endpoint"], "tenant_id": g["tenant_id"], "model": "=SUM(A1)",
           "requests": 2, "prompt_tokens": 3, "completion_tokens": 4, "recorded_at": iso(DAY1)}
    api.client.post("/api/v1/gateway/usage", json={"records": [rec]}, headers=GW)
    query = f"/api/v1/usage?gpu=true&group_by=service,model,day&start={iso(DAY1)}"
    as_json = api.client.get(query, headers=admin).json()["rows"]
    for r in (
        api.client.get(query + "&format=csv", headers=admin),
        api.client.get(query, headers={**admin, "Accept": "text/csv"}),
    ):
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/csv")
        assert r.headers["content-disposition"] == 'attachment; filename="usage.csv"'
        lines = list(csv.reader(io.StringIO(r.text)))
        assert lines == [
            ["service_id", "model", "day", "requests", "prompt_tokens", "completion_tokens",
             "total_tokens", *GPU],
            # quoted, so that a spreadsheet reads it as text
            [g["id"], "'=SUM(A1)", "2026-01-01", "2", "3", "4", "7", "0.0", "0.0", "0.0",
             "0.0"],
            [g["id"], "cmd", "2026-01-01", "0", "0", "0", "0", "400.0", "0.0", "1000.0", "0.0"],
        ]
        assert len(lines) == len(as_json) + 1
    # JSON asked explicitly wins over the Accept header
    r = api.client.get(query + "&format=json", headers={**admin, "Accept": "text/csv"})
    assert r.headers["content-type"].startswith("application/json")
    # without gpu=true: the token columns only
    r = api.client.get("/api/v1/usage?group_by=service&format=csv", headers=admin)
    assert r.text.splitlines() == [
        "service_id,requests,prompt_tokens,completion_tokens,total_tokens",
        f"{g['id']},2,3,4,7",
    ]


@pytest.mark.feature("N4")
def test_without_gpu_the_report_keeps_its_shape(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat("gpu-node", gpus=cards(1))
    g = create(api, admin, name="s", task={"gpu_required": 1})
    api.app.scheduler.run_round()
    agent(api, node, g["tasks"][0]["id"], None)
    api.clock.advance(60)
    rec = {"endpoint_id": g["endpoint"], "tenant_id": g["tenant_id"], "model": "s",
           "requests": 1, "prompt_tokens": 1, "completion_tokens": 1,
           "recorded_at": iso(DAY1)}
    api.client.post("/api/v1/gateway/usage", json={"records": [rec]}, headers=GW)
    plain = api.client.get("/api/v1/usage", headers=admin).json()
    assert set(plain["rows"][0]) == {"tenant_id", "member_id", "endpoint_id", "model",
                                     "requests", "prompt_tokens", "completion_tokens",
                                     "total_tokens"}
    assert set(plain["total"]) == {"requests", "prompt_tokens", "completion_tokens",
                                   "total_tokens"}
    # a new grouping adds its own field only
    by_service = api.client.get("/api/v1/usage?group_by=service", headers=admin).json()
    assert [(r["service_id"], r["requests"]) for r in by_service["rows"]] == [(g["id"], 1)]
    assert "hour" not in by_service["rows"][0] and "gpu_running_card_seconds" not in plain
    with_gpu = usage(api, admin, "group_by=service")
    assert gpu(with_gpu["rows"][0]) == (54.0, 0.0, 60.0, 0.0)  # 90 % (the default), 60 s


@pytest.mark.feature("N4")
def test_a_deleted_service_is_one_row_by_service(api: Api) -> None:
    """issue 33: the usage page showed a deleted service twice. Its key is deleted with it,
    and the report found a record's service through the key: the tokens fell under no
    service while the GPU time (kept per task) stayed under the service's id. The record
    keeps its service from when it was written, so both sum in one row, as before it was
    deleted; a service that never had tokens is not mixed in."""
    admin = api.login()
    node = api.heartbeat("gpu-node", gpus=cards(2))
    gone = create(api, admin, name="gone", task={"gpu_required": 1})
    kept = create(api, admin, name="kept", task={"gpu_required": 1})
    api.app.scheduler.run_round()
    for g in (gone, kept):
        agent(api, node, g["tasks"][0]["id"], None)
    api.clock.advance(60)
    rec = {"endpoint_id": gone["endpoint"], "tenant_id": gone["tenant_id"], "model": "gone",
           "requests": 3, "prompt_tokens": 30, "completion_tokens": 3,
           "recorded_at": iso(DAY1)}
    assert api.client.post("/api/v1/gateway/usage", json={"records": [rec]},
                           headers=GW).status_code == 200
    before = usage(api, admin, "group_by=service")["rows"]
    r = api.client.delete(f"/api/v1/task-groups/{gone['id']}", headers=admin)
    assert r.status_code in (200, 202, 204), r.text
    after = usage(api, admin, "group_by=service")
    rows = {row["service_id"]: (row["requests"], row["total_tokens"], gpu(row)[0])
            for row in after["rows"]}
    assert len(after["rows"]) == 2, after["rows"]  # one row each, none without a service
    assert rows == {row["service_id"]: (row["requests"], row["total_tokens"], gpu(row)[0])
                    for row in before}
    assert rows[gone["id"]] == (3, 33, 54.0)
    assert rows[kept["id"]][:2] == (0, 0)
    # and the filter by service still finds the deleted one's tokens
    only = usage(api, admin, f"service_id={gone['id']}&group_by=")["total"]
    assert (only["requests"], only["total_tokens"]) == (3, 33)


@pytest.mark.feature("N4")
def test_a_failed_task_stops_counting(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat("gpu-node", gpus=cards(1))
    g = create(api, admin, name="f", gpu_memory_utilization=50, task={"gpu_required": 1})
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    agent(api, node, task_id, None)
    api.clock.advance(600)  # starting counts: the card is booked
    agent(api, node, task_id, "failed")
    api.clock.advance(3600)
    assert gpu(usage(api, admin, "group_by=")["total"]) == (300.0, 0.0, 600.0, 0.0)
    assert [(st, end is not None) for _, st, _, _, end in segments(api)] == [("running", True)]


@pytest.mark.parametrize(
    "query",
    [
        "group_by=hour",  # no start
        "group_by=day&end=2026-02-01T00:00:00Z",
        "group_by=hour&start=2026-01-01T00:00:00Z&end=2026-02-01T00:00:01Z",  # > 31 days
        "group_by=day,service&start=2025-01-01T00:00:00Z&end=2026-01-03T00:00:00Z",
    ],
)
@pytest.mark.feature("N4")
def test_bucketed_ranges_are_bounded(api: Api, query: str) -> None:
    r = api.client.get(f"/api/v1/usage?{query}", headers=api.login())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "start"


@pytest.mark.feature("N4")
def test_bucketed_ranges_at_the_bound_pass(api: Api) -> None:
    admin = api.login()
    ok = "group_by=hour&start=2026-01-01T00:00:00Z&end=2026-02-01T00:00:00Z"
    assert api.client.get(f"/api/v1/usage?{ok}", headers=admin).status_code == 200
    # no end: up to now (the fake clock's 2026-01-01)
    ok = "group_by=day&start=2025-01-01T00:00:00Z"
    assert api.client.get(f"/api/v1/usage?{ok}", headers=admin).status_code == 200
