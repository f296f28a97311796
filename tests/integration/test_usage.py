"""Token usage end to end: the OpenAI SDK through the server's gateway into usage_records,
the usage report and its tenant isolation, a separate gateway's hand-in, and the flush at
shutdown. Every test runs on SQLite and PostgreSQL.

The server's own routing snapshot is used for the keys (endpoint, tenant), with the
routes pointed at a fake engine: usage attribution is what is under test, not placement.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy import select

from heteroflow.core.clock import FakeClock
from heteroflow.db.tables import UsageRecord
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.policy.usage import HttpUsageSink, UsageCollector
from heteroflow.schemas.routing import Backend, RoutingSnapshot, SnapshotHolder
from heteroflow.server import ServerApp
from heteroflow.services.serving.routing import build_snapshot
from heteroflow.serving import bind
from heteroflow.settings import ServerSettings
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import ADMIN_PASSWORD, NODE_TOKEN, Api, service_body

GW_TOKEN = "gw-token-for-tests"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[UvicornThread, FakeOpenAIBackend, str]]:
    thread = UvicornThread()
    fake = FakeOpenAIBackend(["engine-u"], name="u")
    url = f"http://127.0.0.1:{thread.serve(fake)}"
    try:
        yield thread, fake, url
    finally:
        thread.stop()


def route_all_to(app: ServerApp, backend_url: str) -> RoutingSnapshot:
    """The server's snapshot (keys from the database), every route served by one engine."""
    with app.db.session() as s:
        snap = build_snapshot(s, 0)
    fake = (Backend(task_id="task-fake", base_url=backend_url),)
    routes = {k: tuple(replace(t, backends=fake) for t in ts) for k, ts in snap.routes.items()}
    out = RoutingSnapshot(version=app.holder.current.version + 1, keys=snap.keys, routes=routes)
    app.holder.publish(out)
    return out


def user_id(api: Api, admin: dict[str, str], username: str) -> str:
    users = api.client.get("/api/v1/users", headers=admin).json()
    return str(next(u["id"] for u in users if u["username"] == username))


def records(app: ServerApp) -> list[UsageRecord]:
    with app.db.session() as s:
        rows = list(s.scalars(select(UsageRecord).order_by(UsageRecord.id)))
        s.expunge_all()
    return rows


@pytest.mark.feature("M7")
@pytest.mark.feature("N4")
def test_sdk_usage_is_attributed_to_endpoint_tenant_and_member(
    api: Api, engine: tuple[UvicornThread, FakeOpenAIBackend, str]
) -> None:
    _, fake, url = engine
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    g = api.client.post(
        "/api/v1/task-groups",
        # served with embeddings too: a model without them is refused at the gateway
        json=service_body(name="chat-u", task={"engine_args": ["--embeddings"]}),
        headers=alice,
    ).json()
    route_all_to(api.app, url)
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key=g["api_key"], http_client=api.client, max_retries=0
    )
    # non-stream: usage from the JSON body
    r = client.chat.completions.create(
        model="chat-u", messages=MSG, extra_body={"fake_prompt_tokens": 7, "fake_chunks": 3}
    )
    assert r.usage is not None and r.usage.prompt_tokens == 7
    # stream, the client did not ask for usage: the gateway asked the engine for it and
    # the client sees exactly what it would without (no choices-less usage chunk)
    chunks = list(
        client.chat.completions.create(
            model="chat-u",
            messages=MSG,
            stream=True,
            extra_body={"fake_prompt_tokens": 5, "fake_chunks": 2},
        )
    )
    assert all(c.choices and c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok tok"
    upstream = fake.received[-1][1]
    assert b'"stream_options":{"include_usage":true}' in upstream
    # stream, the client asked: it gets the usage chunk, untouched
    chunks = list(
        client.chat.completions.create(
            model="chat-u",
            messages=MSG,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"fake_prompt_tokens": 4, "fake_chunks": 4},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    # legacy completions stream and embeddings count too
    list(
        client.completions.create(
            model="chat-u", prompt="x", stream=True, extra_body={"fake_prompt_tokens": 2}
        )
    )
    client.embeddings.create(model="chat-u", input="x")  # the fake reports 1 prompt token
    api.client.portal.call(api.app.usage.flush)  # type: ignore[union-attr]

    rows = records(api.app)
    assert {(r.endpoint_id, r.tenant_id, r.user_id, r.model_name) for r in rows} == {
        (g["endpoint"], g["tenant_id"], user_id(api, admin, "alice"), "chat-u")
    }
    assert sum(r.requests for r in rows) == 5
    assert sum(r.prompt_tokens for r in rows) == 7 + 5 + 4 + 2 + 1
    assert sum(r.completion_tokens for r in rows) == 3 + 2 + 4 + 3 + 0
    report = api.client.get("/api/v1/usage?group_by=member,model", headers=alice).json()
    assert report["rows"] == [
        {
            "tenant_id": None,
            "member_id": user_id(api, admin, "alice"),
            "endpoint_id": None,
            "model": "chat-u",
            "requests": 5,
            "prompt_tokens": 19,
            "completion_tokens": 12,
            "total_tokens": 31,
        }
    ]
    # the gateway's /metrics moved too (served by the gateway on the server's port)
    metrics = api.client.get("/metrics").text
    assert 'heteroflow_gateway_tokens_total{model="chat-u",kind="prompt"} 19' in metrics
    assert (
        'heteroflow_gateway_requests_total{path="/v1/chat/completions",model="chat-u",'
        'status="200"} 3' in metrics
    )


def _record(endpoint: str, tenant: str, at: datetime, model: str = "m", n: int = 1) -> Any:
    return {
        "endpoint_id": endpoint,
        "tenant_id": tenant,
        "model": model,
        "requests": n,
        "prompt_tokens": 10 * n,
        "completion_tokens": n,
        "recorded_at": at.isoformat(),
    }


@pytest.mark.feature("M7")
@pytest.mark.feature("N4")
def test_report_sums_ranges_and_tenant_isolation(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    bob = api.member(admin, "team-b", "bob")
    ga = api.client.post("/api/v1/task-groups", json=service_body(name="a"), headers=alice).json()
    gb = api.client.post("/api/v1/task-groups", json=service_body(name="b"), headers=bob).json()
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    batch = {
        "records": [
            _record(ga["endpoint"], ga["tenant_id"], t0, "m1", 1),
            _record(ga["endpoint"], ga["tenant_id"], t0 + timedelta(hours=1), "m2", 2),
            _record(gb["endpoint"], gb["tenant_id"], t0, "m1", 4),
            # a key deleted before its usage arrived keeps its tenant
            _record("ep-gone", ga["tenant_id"], t0, "m1", 8),
        ]
    }
    gw = {"Authorization": f"Bearer {GW_TOKEN}"}
    r = api.client.post("/api/v1/gateway/usage", json=batch, headers=gw)
    assert r.status_code == 200 and r.json() == {"accepted": 4}

    def get(query: str, who: dict[str, str]) -> Any:
        resp = api.client.get(f"/api/v1/usage?{query}", headers=who)
        assert resp.status_code == 200, resp.text
        return resp.json()

    mine = get("group_by=endpoint", alice)
    assert {(x["endpoint_id"], x["requests"]) for x in mine["rows"]} == {
        (ga["endpoint"], 3),
        ("ep-gone", 8),
    }
    assert mine["total"] == {
        "requests": 11,
        "prompt_tokens": 110,
        "completion_tokens": 11,
        "total_tokens": 121,
    }
    # a member cannot read another tenant: 404, as for every other object
    r = api.client.get(f"/api/v1/usage?tenant_id={gb['tenant_id']}", headers=alice)
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id"
    assert get("group_by=tenant", bob)["rows"][0]["requests"] == 4
    # the operator sees every tenant, or one
    by_tenant = get("group_by=tenant", admin)["rows"]
    assert {(x["tenant_id"], x["requests"]) for x in by_tenant} == {
        (ga["tenant_id"], 11),
        (gb["tenant_id"], 4),
    }
    assert get(f"group_by=model&tenant_id={gb['tenant_id']}", admin)["total"]["requests"] == 4
    # [start, end): the second hour only; filters by model and endpoint
    start = (t0 + timedelta(minutes=30)).isoformat().replace("+00:00", "Z")
    assert get(f"group_by=&start={start}", alice)["total"]["requests"] == 2
    assert get(f"end={start}&model=m1", alice)["total"]["requests"] == 9
    assert get(f"endpoint_id={ga['endpoint']}&model=m1", alice)["total"]["requests"] == 1
    members = get("group_by=member", alice)["rows"]
    assert {(x["member_id"], x["requests"]) for x in members} == {
        (user_id(api, admin, "alice"), 3),
        ("", 8),
    }


@pytest.mark.feature("M7")
@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("group_by=colour", "group_by"),
        ("group_by=model,model", "group_by"),
        ("start=2026-03-02T00:00:00Z&end=2026-03-01T00:00:00Z", "start"),
        ("start=yesterday", "start"),
    ],
)
def test_report_validation_names_the_field(api: Api, query: str, field: str) -> None:
    r = api.client.get(f"/api/v1/usage?{query}", headers=api.login())
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"]["field"] or "")


@pytest.mark.feature("M7")
def test_hand_in_needs_the_gateway_token_and_valid_records(api: Api) -> None:
    at = datetime(2026, 3, 1, tzinfo=UTC)
    batch = {"records": [_record("ep", "tn", at)]}
    assert api.client.post("/api/v1/gateway/usage", json=batch).status_code == 401
    member = api.member(api.login(), "team-x", "xavier")
    assert api.client.post("/api/v1/gateway/usage", json=batch, headers=member).status_code == 401
    gw = {"Authorization": f"Bearer {GW_TOKEN}"}
    bad = {"records": [{**_record("ep", "tn", at), "requests": -1}]}
    r = api.client.post("/api/v1/gateway/usage", json=bad, headers=gw)
    assert r.status_code == 400 and r.json()["error"]["field"] == "records.0.requests"
    naive = {"records": [{**_record("ep", "tn", at), "recorded_at": "2026-03-01T00:00:00"}]}
    r = api.client.post("/api/v1/gateway/usage", json=naive, headers=gw)
    assert r.status_code == 400 and r.json()["error"]["field"] == "records.0.recorded_at"
    assert records(api.app) == []


@pytest.mark.feature("M7")
def test_shutdown_flushes_everything_including_a_separate_gateway(
    db_url: str, tmp_path: Path, engine: tuple[UvicornThread, FakeOpenAIBackend, str]
) -> None:
    thread, _, backend_url = engine
    settings = ServerSettings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        admin_password=ADMIN_PASSWORD,
        node_token=NODE_TOKEN,
        gateway_token=GW_TOKEN,
        snapshot_interval_s=3600.0,
        usage_flush_interval_s=3600.0,  # only the shutdown flush can write
    )
    app = ServerApp(settings, clock=FakeClock())
    sock = bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop = thread.call(_event())
    serving = asyncio.run_coroutine_threadsafe(app.serve(stop, sock), thread.loop)
    gateway: GatewayApp | None = None
    try:
        with httpx.Client(base_url=base, timeout=10.0) as http:
            _wait_until(lambda: _up(http) and app.holder.current.version >= 1)
            token = http.post(
                "/api/v1/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}
            ).json()["access_token"]
            admin = {"Authorization": f"Bearer {token}"}
            g = http.post("/api/v1/task-groups", json=service_body(name="sd"), headers=admin).json()
        # The API commits in its session dependency's exit, which FastAPI runs after the
        # 201 went out: wait until the new key and its route are readable.
        _wait_until(
            lambda: any("sd" in k.models for k in route_all_to(app, backend_url).keys.values())
        )
        snap = app.holder.current
        # a separate gateway process' pieces: its own snapshot copy, usage to the server
        collector = UsageCollector(HttpUsageSink(base, GW_TOKEN), FakeClock(), interval_s=3600.0)
        gateway = GatewayApp(SnapshotHolder(snap), usage=collector)
        gw_port = thread.serve(gateway)
        for url in (f"{base}/v1", f"{base}/v1", f"http://127.0.0.1:{gw_port}/v1"):
            with openai.OpenAI(base_url=url, api_key=g["api_key"], max_retries=0) as client:
                client.chat.completions.create(
                    model="sd", messages=MSG, extra_body={"fake_prompt_tokens": 6}
                )
        assert records(app) == []  # nothing flushed yet
        thread.call(collector.close())  # the separate gateway stops: it hands its rest in
        assert sum(r.requests for r in records(app)) == 1
    finally:
        thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        if gateway is not None:
            thread.call(gateway.aclose())
    rows = records(app)  # read after the server stopped
    app.db.dispose()
    assert sum(r.requests for r in rows) == 3
    assert sum(r.prompt_tokens for r in rows) == 18
    assert {r.endpoint_id for r in rows} == {g["endpoint"]}


async def _event() -> asyncio.Event:
    return asyncio.Event()


def _up(http: httpx.Client) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def _wait_until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.feature("M7")
def test_the_server_writes_usage_batches_while_it_runs(db_url: str, tmp_path: Path) -> None:
    """Batches land every usage_flush_interval_s, not only at shutdown."""
    settings = ServerSettings(
        data_dir=tmp_path / "data", database_url=db_url, admin_password=ADMIN_PASSWORD,
        node_token=NODE_TOKEN, gateway_token=GW_TOKEN, usage_flush_interval_s=0.2,
    )
    app = ServerApp(settings, clock=FakeClock())
    thread = UvicornThread()
    sock = bind("127.0.0.1", 0)
    stop = thread.call(_event())
    serving = asyncio.run_coroutine_threadsafe(app.serve(stop, sock), thread.loop)
    try:
        thread.call(_count_one(app))
        _wait_until(lambda: len(records(app)) == 1, timeout=5.0)
        assert records(app)[0].requests == 1
    finally:
        thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        thread.stop()


async def _count_one(app: ServerApp) -> None:
    app.usage.record("ep-000000000001", "tn-000000000001", "m", None)
