"""The autoscaler loop (I1) on a real database with a fake clock: the gateways' load
reports posted by hand (and once produced by the real gateway in front of a fake engine),
the agent protocol driven by hand.

Proven: under load it scales out the whole difference at once (clamped to max, with the
numbers on the timeline); it does not scale down a replica younger than 60 s, then goes
back to min when idle; it skips a service outside its schedule window, being updated,
stopped or asleep, and one no gateway reports on; each decision is one event (a steady
one is not repeated); every metric reads the reports; only the leader runs it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import openai
import pytest
from sqlalchemy import update

from heteroflow.db.tables import TaskGroup
from heteroflow.schemas.routing import Backend, RoutingSnapshot
from heteroflow.services.leadership import LeaseLost
from heteroflow.services.lifecycle.scaling import AutoscaleOutcome
from heteroflow.services.serving.routing import build_snapshot
from heteroflow.services.tenancy.usage import read_load
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import Api
from .test_scale import backend, create, events, group, report_load, run_all


def autoscale(api: Api) -> dict[str, AutoscaleOutcome]:
    api.app.leadership.reconcile_once(api.clock.now())
    return {o.group_id: o for o in api.app.autoscaler.run_round()}


def decisions(api: Api, headers: dict[str, str], gid: str) -> list[dict[str, Any]]:
    return events(api, headers, gid, "group.autoscale")


def ids(api: Api, headers: dict[str, str], gid: str) -> list[str]:
    return [t["id"] for t in group(api, headers, gid)["tasks"]]


@pytest.mark.feature("I1")
def test_under_load_it_scales_out_at_once_then_back_to_min_when_idle(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, scale_policy={"metric": "inflight", "target": 2, "max_replicas": 3}
                 )["id"]
    run_all(api, node, admin, gid)
    [t0] = ids(api, admin, gid)

    # 9 requests in flight on one replica, target 2: ceil(1 * 9 / 2) = 5, clamped to 3
    report_load(api, [backend(t0, gid, 9)])
    out = autoscale(api)[gid]
    assert out.decision is not None and (out.decision.raw, out.decision.desired) == (5, 3)
    assert out.scaled is not None and len(out.scaled.added) == 2  # the whole diff at once
    g = group(api, admin, gid)
    assert (g["current_replicas"], len(g["tasks"])) == (3, 3)
    [first] = decisions(api, admin, gid)
    assert (first["from_status"], first["to_status"]) == ("1", "3:clamped")
    text = first["message"]
    assert "inflight 9.00" in text and "target 2" in text and "= 5" in text
    assert "clamped to max_replicas 3" in text and "scale 1 → 3" in text
    scaled = events(api, admin, gid, "group.scaled")[-1]
    assert "by the autoscaler (inflight 9.00 per replica, target 2)" in scaled["message"]

    # the same load over 3 replicas: still 3 (clamped) — said once, not every round
    autoscale(api)
    autoscale(api)
    assert [(e["from_status"], e["to_status"]) for e in decisions(api, admin, gid)] == [
        ("1", "3:clamped"), ("3", "3:clamped"),
    ]

    run_all(api, node, admin, gid)  # the new replicas run from now on
    tasks = ids(api, admin, gid)
    # idle: min_replicas, but the new replicas are younger than 60 s
    api.clock.advance(30)
    report_load(api, [backend(t, gid, 0) for t in tasks])
    out = autoscale(api)[gid]
    assert out.decision is not None and (out.decision.raw, out.decision.desired) == (1, 3)
    assert out.scaled is None
    held = decisions(api, admin, gid)[-1]
    assert held["to_status"] == "3:held" and "younger than 60 s" in held["message"]
    # past 60 s: back to min at once; the leaving ones drain first
    api.clock.advance(31)
    report_load(api, [backend(t, gid, 0) for t in tasks])
    out = autoscale(api)[gid]
    assert out.scaled is not None and out.scaled.after == 1
    assert sorted(out.scaled.draining) == sorted(tasks[1:])
    assert ids(api, admin, gid) == [t0]  # rank 0 is never scaled away
    last = decisions(api, admin, gid)[-1]
    assert (last["from_status"], last["to_status"]) == ("3", "1")
    assert "idle, min_replicas 1" in last["message"]


@pytest.mark.feature("I1")
def test_it_skips_windows_updates_stopped_asleep_and_services_nobody_reports_on(
    api: Api,
) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, scale_policy={"metric": "inflight", "target": 1, "max_replicas": 3}
                 )["id"]
    off = create(api, admin, name="off", max_replicas=3)["id"]  # no policy: never looked at
    run_all(api, node, admin, gid)
    run_all(api, node, admin, off)
    [t0] = ids(api, admin, gid)

    # nothing reported: no decision, said once
    out = autoscale(api)
    decision = out[gid].decision
    assert set(out) == {gid} and decision is not None
    assert decision.no_data.startswith("no gateway reported its load")
    autoscale(api)
    [nodata] = decisions(api, admin, gid)
    assert nodata["to_status"] == "skip:no-data"
    assert group(api, admin, gid)["current_replicas"] == 1

    report_load(api, [backend(t0, gid, 3)])  # enough load for 3 replicas
    for column, value, key in (
        ("window_action", "scale", "window"),
        ("rollout_holder", "srv-other", "rollout"),
    ):
        with api.app.db.session() as s:
            s.execute(update(TaskGroup).where(TaskGroup.id == gid).values({column: value}))
        skipped = autoscale(api)[gid].skipped
        assert skipped is not None and skipped[0] == key
        assert decisions(api, admin, gid)[-1]["to_status"] == f"skip:{key}"
        assert group(api, admin, gid)["current_replicas"] == 1
        with api.app.db.session() as s:
            s.execute(update(TaskGroup).where(TaskGroup.id == gid).values({column: ""}))

    r = api.client.post(f"/api/v1/task-groups/{gid}/sleep", headers=admin)
    assert r.status_code in (200, 202) and r.json()["slept"] == [t0], r.text
    assert autoscale(api)[gid].skipped == ("asleep", "the service is asleep or waking")
    assert api.client.post(f"/api/v1/task-groups/{gid}/stop", headers=admin).status_code == 200
    skipped = autoscale(api)[gid].skipped
    assert skipped is not None and skipped[0] == "stopped"
    kinds = [e["to_status"] for e in decisions(api, admin, gid)]
    assert kinds == ["skip:no-data", "skip:window", "skip:rollout", "skip:asleep", "skip:stopped"]
    assert group(api, admin, gid)["current_replicas"] == 1
    assert decisions(api, admin, off) == []

    # disabled: left alone, nothing written
    r = api.client.put(f"/api/v1/task-groups/{gid}/scale-policy", json={"enabled": False},
                       headers=admin)
    assert r.status_code == 200, r.text
    assert gid not in autoscale(api)


@pytest.mark.feature("I1")
@pytest.mark.parametrize(
    ("metric", "target", "figures", "desired"),
    [
        # tokens/s: 300 over one replica, 100 per replica wanted -> 3
        ("tokens_per_s", 100, {"tokens_per_s": 300.0}, 3),
        # the engine's own queue: 4 waiting, 2 per replica wanted -> 2
        ("queue", 2, {"waiting": 4.0}, 2),
        # KV cache 90 % in use, 45 % wanted -> 2
        ("kv_cache", 45, {"kv_use": 0.9}, 2),
    ],
)
def test_every_metric_scales_from_the_reports(
    api: Api, metric: str, target: float, figures: dict[str, float], desired: int
) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, scale_policy={"metric": metric, "target": target,
                                            "max_replicas": 4})["id"]
    run_all(api, node, admin, gid)
    [t0] = ids(api, admin, gid)
    report_load(api, [{**backend(t0, gid, 0), **figures}])
    out = autoscale(api)[gid]
    assert out.decision is not None and out.decision.desired == desired, out.decision
    assert group(api, admin, gid)["current_replicas"] == desired
    if metric in ("queue", "kv_cache"):  # an engine that exports nothing: no data
        report_load(api, [backend(t, gid, 0) for t in ids(api, admin, gid)])
        out = autoscale(api)[gid]
        assert out.decision is not None and "no engine of this service" in out.decision.no_data


@pytest.mark.feature("I1")
def test_only_the_leader_decides(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat()
    gid = create(api, admin, scale_policy={"metric": "inflight", "target": 1, "max_replicas": 2}
                 )["id"]
    run_all(api, node, admin, gid)
    report_load(api, [backend(ids(api, admin, gid)[0], gid, 5)])
    with pytest.raises(LeaseLost):  # this instance never took the lease
        api.app.autoscaler.run_round()
    with pytest.raises(LeaseLost):
        api.app.scale_drainer.run_round()
    assert decisions(api, admin, gid) == []
    assert api.app.autoscaler.leader_only and api.app.scale_drainer.leader_only


@pytest.mark.feature("I1")
def test_the_gateway_reports_tokens_and_in_flight_per_backend_with_its_flush(api: Api) -> None:
    """The real gateway (in the server's process) in front of a fake engine: what it
    answered reaches the load report, and the autoscaler reads it."""
    admin = api.login()
    node = api.heartbeat()
    g = create(api, admin, name="chat", scale_policy={"metric": "tokens_per_s", "target": 1,
                                                       "max_replicas": 2})
    gid = g["id"]
    run_all(api, node, admin, gid)
    [t0] = ids(api, admin, gid)
    thread = UvicornThread()
    try:
        url = f"http://127.0.0.1:{thread.serve(FakeOpenAIBackend(['engine-a'], name='a'))}"
        with api.app.db.session() as s:
            snap = build_snapshot(s, 0)
        fake = (Backend(task_id=t0, base_url=url, group_id=gid),)
        api.app.holder.publish(
            RoutingSnapshot(
                version=api.app.holder.current.version + 1,
                keys=snap.keys,
                routes={k: tuple(replace(t, backends=fake) for t in ts)
                        for k, ts in snap.routes.items()},
            )
        )
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=g["api_key"],
                               http_client=api.client, max_retries=0)
        for _ in range(3):
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}],
                extra_body={"fake_prompt_tokens": 7, "fake_chunks": 3},
            )
        api.clock.advance(5)  # the collector's window: 5 s so far
        api.client.portal.call(api.app.usage.flush)  # type: ignore[union-attr]
    finally:
        thread.stop()
    with api.app.db.session() as s:
        view = read_load(s, api.clock.now(), 20)
    assert view.gateways == 1 and view.in_flight(t0) == 0
    assert view.tokens_per_s(t0) == pytest.approx(3 * (7 + 3) / 5)
    [sample] = view.samples[t0]
    assert sample.draining is False
    out = autoscale(api)[gid]
    assert out.decision is not None and out.decision.value == pytest.approx(6.0)
    assert group(api, admin, gid)["current_replicas"] == 2
