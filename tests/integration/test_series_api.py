"""The live series (issue 33) through the API: sampled from a gateway's load report into
the database, read back tenant-scoped, refused with the field named on bad input, and
still there after a server restart. SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient

from heteroflow.db.engine import Database
from heteroflow.schemas.usage import BackendLoad, GatewayLoad
from heteroflow.server import ServerApp
from heteroflow.services.series import store
from heteroflow.services.series.sampler import Sampler
from heteroflow.services.tenancy.usage import write_load

from .conftest import Api, service_body


def _report(
    db: Database, api: Api, group_id: str, answered: int, errors: int, refused: int = 0
) -> None:
    load = GatewayLoad(
        "gw-test",
        (
            BackendLoad(
                task_id="task-x", group_id=group_id, draining=False, in_flight=3,
                tokens_per_s=42.0, waiting=1.0, answered=answered,
                errors={"5xx": errors}, latency_ms=[120.0, 480.0], ttft_ms=[30.0, 90.0],
            ),
        ),
        # refused before a backend was chosen (no healthy backend): the service's own
        {group_id: {"5xx": refused}} if refused else {},
    )
    with db.session() as s:
        write_load(s, load, api.clock.now())


def _sample(db: Database, sampler: Sampler, api: Api) -> None:
    with db.session() as s:
        store.write(s, api.clock.now(), sampler.sample(s, api.clock.now()))
        store.prune(s, api.clock.now())


def test_series_are_sampled_scoped_validated_and_survive_a_restart(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "t-series-a", "alice-series")
    bob = api.member(admin, "t-series-b", "bob-series")
    r = api.client.post("/api/v1/task-groups", json=service_body(name="live"), headers=alice)
    assert r.status_code == 201, r.text
    gid = r.json()["group"]["id"] if "group" in r.json() else r.json()["id"]
    db = api.app.db
    sampler = Sampler(load_stale_s=30.0, offline_after_s=30.0)
    _report(db, api, gid, answered=100, errors=0)
    _sample(db, sampler, api)  # the first sample: no rate yet
    api.clock.advance(10)
    # 50 answers and 5 errors in 10 s, and 10 refused before reaching a backend
    _report(db, api, gid, answered=150, errors=5, refused=10)
    _sample(db, sampler, api)

    url = f"/api/v1/task-groups/{gid}/series"
    r = api.client.get(url, params={"since": "5m"}, headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["step"] == 10
    assert len(body["times"]) == 2
    assert body["values"]["requests_per_s"] == [None, 5.0]  # the refusals had no count before
    assert body["values"]["errors_5xx_per_s"][-1] == 0.5
    assert body["values"]["errors_per_s"][-1] == 0.5
    assert body["values"]["in_flight"] == [3.0, 3.0]
    assert body["values"]["latency_p95_ms"][-1] == 480.0
    assert body["values"]["ttft_p50_ms"][-1] == 30.0
    assert body["values"]["replicas"][-1] == 0.0  # nothing runs: the report is all there is
    minute = api.client.get(url, params={"since": "2h", "step": 60}, headers=alice).json()
    assert minute["step"] == 60 and minute["values"]["in_flight"] == [3.0]
    assert minute["values"]["requests_per_s"] == [5.0]  # the first sample had no rate
    # a round 5 s later lands in the same 10 s: its point replaces that one (no answer
    # since, 10 more refused before reaching a backend: 2/s, all errors), and the minute
    # is the mean of its three samples
    api.clock.advance(5)
    _report(db, api, gid, answered=150, errors=5, refused=20)
    _sample(db, sampler, api)
    body = api.client.get(url, params={"since": "5m"}, headers=alice).json()
    assert body["values"]["requests_per_s"] == [None, 2.0]
    assert body["values"]["errors_5xx_per_s"] == [None, 2.0]
    minute = api.client.get(url, params={"since": "2h", "step": 60}, headers=alice).json()
    assert minute["values"]["requests_per_s"] == [3.5]
    assert minute["values"]["in_flight"] == [3.0]
    # a coarser step than stored is a mean over it
    coarse = api.client.get(url, params={"since": "5m", "step": 30}, headers=alice).json()
    assert coarse["step"] == 30 and coarse["values"]["in_flight"] == [3.0]

    # tenant-scoped: another tenant's member does not see the service at all
    assert api.client.get(url, headers=bob).status_code == 404
    assert api.client.get(url, headers=admin).status_code == 200

    # bad input: 400 naming the field
    bad: list[tuple[dict[str, str | int], str]] = [
        ({"metrics": "requests_per_s,bogus"}, "metrics"),
        ({"since": "48h"}, "since"),
        ({"since": "yesterday"}, "since"),
        ({"step": 15}, "step"),
        ({"since": "6h", "step": 10}, "step"),
    ]
    for params, field in bad:
        r = api.client.get(url, params=params, headers=alice)
        assert r.status_code == 400, (params, r.text)
        assert field in r.text, (params, r.text)
    r = api.client.get(url, params={"step": "ten"}, headers=alice)
    assert r.status_code == 400 and "step" in r.text

    # the overview: a member sees their own tenant's services only
    mine = api.client.get("/api/v1/fleet/overview", headers=alice).json()
    theirs = api.client.get("/api/v1/fleet/overview", headers=bob).json()
    assert sum(mine["services_by_state"].values()) == 1
    assert sum(theirs["services_by_state"].values()) == 0

    # the points outlive the server: a new instance on the same database reads them
    restarted = ServerApp(api.app.settings, clock=api.clock)
    with TestClient(restarted.asgi) as client:
        token = client.post(
            "/api/v1/auth/login", json={"username": "alice-series", "password": "member-pass-1"}
        ).json()["access_token"]
        again = client.get(url, params={"since": "5m"},
                           headers={"Authorization": f"Bearer {token}"}).json()
    restarted.db.dispose()
    assert again["values"]["requests_per_s"] == [None, 2.0]

    # the bound: raw points past an hour and minute points past 24 h are deleted
    api.clock.advance(int(timedelta(hours=25).total_seconds()))
    _report(db, api, gid, answered=150, errors=5)
    _sample(db, sampler, api)
    alice = api.login("alice-series", "member-pass-1")  # a day later: a new token
    late = api.client.get(url, params={"since": "24h"}, headers=alice).json()
    assert len(late["times"]) == 1  # only the new minute: the old ones were deleted
    with db.session() as s:
        assert len(store.read(s, "service", gid, 10, api.clock.now() - timedelta(days=3))) == 1


def test_a_nodes_series_carry_its_cards_memory_commitment_and_temperature(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat(gpus=[{
        "index": 0, "uuid": "GPU-0", "model": "L4", "memory_total_mb": 23034,
        "memory_used_mb": 1200, "temperature_c": 41, "utilization_pct": 37,
    }])
    # a one-card inference replica on it books its gpu_memory_utilization (90 %)
    r = api.client.post("/api/v1/task-groups", headers=admin,
                        json=service_body(name="on-card", task={"gpu_required": 1}))
    assert r.status_code == 201, r.text
    gid = r.json()["id"]
    api.app.scheduler.reconcile_once(api.clock.now())
    (task,) = api.client.get(f"/api/v1/task-groups/{gid}", headers=admin).json()["tasks"]
    # two gateways see its replica: in flight adds up, the engine's figures do not
    for gw, in_flight in (("gw-a", 2), ("gw-b", 1)):
        with api.app.db.session() as s:
            write_load(s, GatewayLoad(gw, (BackendLoad(
                task_id=task["id"], group_id=gid, draining=False, in_flight=in_flight,
                tokens_per_s=10.0, waiting=3.0, kv_use=0.25, latency_ms=[50.0, 90.0 + in_flight],
                prefix=(300.0, 400.0), ms_per_token=10.0 * in_flight,
            ),)), api.clock.now())
    sampler = Sampler(load_stale_s=30.0, offline_after_s=30.0)
    _sample(api.app.db, sampler, api)
    r = api.client.get(f"/api/v1/nodes/{node_id}/series", params={"since": "5m"}, headers=admin)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["node"]["key"] == node_id and len(body["node"]["times"]) == 1
    (card,) = body["cards"]
    assert card["key"] == f"{node_id}/0"
    assert card["values"]["memory_used_mb"] == [1200.0]
    assert card["values"]["memory_total_mb"] == [23034.0]
    assert card["values"]["temperature_c"] == [41.0]
    assert card["values"]["committed_pct"] == [90.0]
    assert card["values"]["utilisation_pct"] == [37.0]  # as the agent's NVML read it
    only = api.client.get(f"/api/v1/nodes/{node_id}/series",
                          params={"metrics": "committed_pct"}, headers=admin).json()
    assert list(only["node"]["values"]) == [] and list(only["cards"][0]["values"]) == [
        "committed_pct"]
    r = api.client.get(f"/api/v1/nodes/{node_id}/series", params={"metrics": "rpm"},
                       headers=admin)
    assert r.status_code == 400 and "metrics" in r.text
    assert api.client.get("/api/v1/nodes/node-nope/series", headers=admin).status_code == 404
    # the service page's replica rows: each replica's load now, as the gateways report it
    (row,) = api.client.get(f"/api/v1/task-groups/{gid}/series", headers=admin).json()[
        "replicas"]
    assert row["task_id"] == task["id"] and row["gateways"] == 2
    assert (row["in_flight"], row["tokens_per_s"], row["queue"], row["kv_use"]) == (
        3, 20.0, 3.0, 0.25)
    assert row["latency_p95_ms"] == 92.0 and row["ms_per_token"] == 15.0
    assert row["prefix_hit_rate"] == 0.75 and row["slots"] is None
