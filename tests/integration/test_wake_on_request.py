"""F6 with the real server and gateway: a sleeping model is listed by /v1/models, and a
request for it wakes it — held until it is up and then answered (the all-in-one's
gateway, and a separate gateway over HTTP with the gateway token), or answered 503 with
Retry-After when holding is off or the wake cannot happen.

The server is the ``api`` fixture's ``ServerApp`` (fake clock, both databases), served by
uvicorn on a background loop so that a held request does not block the test; the
engine is a fake OpenAI backend whose port the service maps as its fixed host port; the
agent's part (claim, report running) is played through the agent API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from heteroflow.db.tables import TaskGroup
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.policy.usage import HttpUsageSink, UsageCollector
from heteroflow.gateway.routing.hold import HttpServerLink
from heteroflow.gateway.routing.poller import SnapshotPoller
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import Api, service_body

GATEWAY_TOKEN = "gw-token-for-tests"
MSG: list[Any] = [{"role": "user", "content": "hi"}]


@dataclass
class Live:
    api: Api
    thread: UvicornThread
    port: int  # the server (API + embedded gateway) under uvicorn
    engine: FakeOpenAIBackend
    engine_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def live(api: Api) -> Iterator[Live]:
    thread = UvicornThread()
    engine = FakeOpenAIBackend(["engine-model"])
    engine_port = thread.serve(engine)
    port = thread.serve(api.app.asgi)
    try:
        yield Live(api, thread, port, engine, engine_port)
    finally:
        thread.call(api.app.gateway.aclose())
        thread.stop()


def _asleep_service(lv: Live, admin: dict[str, str], **over: Any) -> dict[str, Any]:
    """A running service on the fake engine's port, then put to sleep through the API."""
    api = lv.api
    node = api.heartbeat()
    body = service_body(
        model_name="chat",
        task={"ports": [{"container_port": 8080, "host_port": lv.engine_port}]},
        **over,
    )
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    g: dict[str, Any] = r.json()
    g["node"] = node
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    assert _report(api, node, task_id, "running").status_code == 200
    r = api.client.post(f"/api/v1/task-groups/{g['id']}/sleep", headers=admin)
    assert r.status_code == 202, r.text
    api.app.publisher.refresh()
    return g


def _report(api: Api, node: str, task_id: str, status: str) -> httpx.Response:
    r: httpx.Response = api.agent_post(
        node, f"/api/v1/agent/tasks/{task_id}/report", {"status": status}
    )
    return r


def _task_status(api: Api, admin: dict[str, str], task_id: str) -> str:
    return str(api.client.get(f"/api/v1/tasks/{task_id}", headers=admin).json()["status"])


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # handed to the test
            out.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def _wake_up_when_asked(lv: Live, admin: dict[str, str], g: dict[str, Any]) -> None:
    """The agent's part of a wake: once the task is waking, its engine is up."""
    task_id = g["tasks"][0]["id"]
    _wait_for(lambda: _task_status(lv.api, admin, task_id) == "waking")
    lv.api.heartbeat()
    assert _report(lv.api, g["node"], task_id, "running").status_code == 200


@pytest.mark.feature("F6")
def test_a_sleeping_model_is_listed_and_a_request_wakes_it_and_is_answered(live: Live) -> None:
    lv, api = live, live.api
    admin = api.login()
    g = _asleep_service(lv, admin)
    client = openai.OpenAI(base_url=lv.url + "/v1", api_key=g["api_key"], max_retries=0)
    try:
        # listed, not routable
        assert [m.id for m in client.models.list()] == ["chat"]
        (target,) = api.app.holder.current.routes[g["tenant_id"], "chat"]
        assert target.asleep == "sleeping" and target.backends == ()
        waiting, out = _in_thread(
            lambda: client.chat.completions.create(model="chat", messages=MSG)
        )
        _wake_up_when_asked(lv, admin, g)  # the request woke it
        waiting.join(15)
        assert not waiting.is_alive()
        (answer,) = out
        assert not isinstance(answer, Exception), answer
        assert answer.choices[0].message.content
        assert lv.engine.received_models[-1] == "engine-model"
        # a stream is held the same way: its first chunk comes once the engine is up
        r = api.client.post(f"/api/v1/task-groups/{g['id']}/sleep", headers=admin)
        assert r.status_code == 202
        api.app.publisher.refresh()
        waiting, out = _in_thread(
            lambda: list(
                client.chat.completions.create(model="chat", messages=MSG, stream=True)
            )
        )
        _wake_up_when_asked(lv, admin, g)
        waiting.join(15)
        (chunks,) = out
        assert not isinstance(chunks, Exception), chunks
        assert chunks and any(c.choices and c.choices[0].delta.content for c in chunks)
    finally:
        client.close()
    metrics = httpx.get(lv.url + "/metrics").text
    assert 'heteroflow_gateway_wake_holds_total{model="chat",outcome="ready"} 2' in metrics
    assert 'heteroflow_gateway_wakes_total{model="chat",branch="waking"} 2' in metrics
    # F4: the answered requests were noted as the group's last activity
    lv.thread.call(api.app.usage.flush())
    with api.app.db.session() as s:
        row = s.get(TaskGroup, g["id"])
        assert row is not None and row.last_request_at is not None


@pytest.mark.feature("F6")
def test_with_holding_off_the_answer_is_503_retry_after_and_the_wake_started(
    live: Live,
) -> None:
    lv, api = live, live.api
    admin = api.login()
    g = _asleep_service(lv, admin)
    api.app.gateway.hold.hold_s = 0  # HETEROFLOW_GATEWAY_WAKE_HOLD_S=0
    r = httpx.post(
        lv.url + "/v1/chat/completions",
        json={"model": "chat", "messages": MSG},
        headers={"Authorization": f"Bearer {g['api_key']}"},
        timeout=10,
    )
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(api.app.settings.gateway_wake_retry_after_s)
    assert r.json()["error"]["code"] == "model_waking"
    assert _task_status(api, admin, g["tasks"][0]["id"]) == "waking"
    # the OpenAI SDK retries a 503 after Retry-After; once up, the retry is answered
    _report(api, g["node"], g["tasks"][0]["id"], "running")
    api.app.publisher.refresh()
    client = openai.OpenAI(base_url=lv.url + "/v1", api_key=g["api_key"], max_retries=0)
    try:
        assert client.chat.completions.create(model="chat", messages=MSG).choices
    finally:
        client.close()


@pytest.mark.feature("F6")
def test_a_wake_that_cannot_happen_is_503_naming_why(live: Live) -> None:
    lv, api = live, live.api
    admin = api.login()
    g = _asleep_service(lv, admin)
    api.clock.advance(api.app.settings.node_offline_after_s + 5)  # the node went quiet
    t0 = time.monotonic()
    r = httpx.post(
        lv.url + "/v1/chat/completions",
        json={"model": "chat", "messages": MSG},
        headers={"Authorization": f"Bearer {g['api_key']}"},
        timeout=30,
    )
    assert time.monotonic() - t0 < 5  # answered at once, not held for 120 s
    assert r.status_code == 503 and "retry-after" in r.headers
    err = r.json()["error"]
    assert err["code"] == "model_unavailable"
    assert "offline" in err["message"]
    assert _task_status(api, admin, g["tasks"][0]["id"]) == "sleeping"
    metrics = httpx.get(lv.url + "/metrics").text
    assert 'heteroflow_gateway_wakes_total{model="chat",branch="node_offline"} 1' in metrics


@pytest.mark.feature("F6")
@pytest.mark.feature("F4")
def test_a_separate_gateway_wakes_over_http_and_reports_activity(live: Live) -> None:
    lv, api = live, live.api
    admin = api.login()
    g = _asleep_service(lv, admin)
    # a separate gateway as `heteroflow gateway --server URL` builds it
    holder = SnapshotHolder()
    usage = UsageCollector(HttpUsageSink(lv.url, GATEWAY_TOKEN), api.clock)
    gateway = GatewayApp.from_settings(api.app.settings, holder, usage=usage)
    assert isinstance(gateway.hold.link, HttpServerLink)
    poller = SnapshotPoller(lv.url, GATEWAY_TOKEN, holder)
    lv.thread.call(poller.poll_once())
    gw_port = lv.thread.serve(gateway)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{gw_port}/v1", api_key=g["api_key"], max_retries=0
    )
    try:
        assert [m.id for m in client.models.list()] == ["chat"]

        def server_snapshots() -> None:  # the server's publisher loop (not run by the fixture)
            while waiting.is_alive():
                api.app.publisher.refresh()
                time.sleep(0.1)

        waiting, out = _in_thread(
            lambda: client.chat.completions.create(model="chat", messages=MSG)
        )
        publishing = threading.Thread(target=server_snapshots, daemon=True)
        publishing.start()
        _wake_up_when_asked(lv, admin, g)
        waiting.join(15)
        (answer,) = out
        assert not isinstance(answer, Exception), answer
        assert answer.choices
        # F4: its flush reaches the server's database over HTTP
        assert lv.thread.call(usage.flush())
        with api.app.db.session() as s:
            row = s.get(TaskGroup, g["id"])
            assert row is not None and row.last_request_at is not None
    finally:
        client.close()
        lv.thread.call(poller.aclose())
        lv.thread.call(gateway.aclose())


def test_the_wake_route_is_for_gateways_and_answers_per_task(live: Live) -> None:
    lv, api = live, live.api
    admin = api.login()
    g = _asleep_service(lv, admin)
    body = {"group_ids": [g["id"], "tg-nosuchgroup"], "model": "chat"}
    assert api.client.post("/api/v1/gateway/wake", json=body).status_code == 401
    alice = api.member(admin, "team-a", "alice")
    r = api.client.post("/api/v1/gateway/wake", json=body, headers=alice)
    assert r.status_code in (401, 403)
    assert _task_status(api, admin, g["tasks"][0]["id"]) == "sleeping"
    r = api.client.post(
        "/api/v1/gateway/wake", json=body, headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    )
    assert r.status_code == 200, r.text
    results = {x["group_id"]: x for x in r.json()["results"]}
    assert results[g["id"]]["branch"] == "waking"
    assert results[g["id"]]["task_id"] == g["tasks"][0]["id"]
    assert results["tg-nosuchgroup"]["branch"] == "failed"
    assert "not found" in results["tg-nosuchgroup"]["message"]
    assert _task_status(api, admin, g["tasks"][0]["id"]) == "waking"
    bad = {"group_ids": [], "model": "chat"}
    r = api.client.post(
        "/api/v1/gateway/wake", json=bad, headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    )
    assert r.status_code == 400
