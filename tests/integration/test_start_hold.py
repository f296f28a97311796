"""M17 with the real server and its gateway: a request for a model whose replicas are
starting is held until one is up and then answered (200, not 503 "No healthy backend");
held too long it is answered 503 + Retry-After saying how long they have been starting;
a service whose replicas all failed is refused at once, as before.

The server is the ``api`` fixture's ``ServerApp`` (fake clock) served by uvicorn on a
background loop so that a held request does not block the test; the engine is a fake
OpenAI backend whose port the service maps as its fixed host port; the scheduler's round
and the agent's part (claim, report running) are played by the test while the request
waits. No publisher loop runs: only the hold's own refreshes bring the new snapshot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import Api, service_body

MSG: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def live(api: Api) -> Iterator[tuple[Api, int, int]]:
    """(the api, the server's port under uvicorn, the fake engine's port)."""
    thread = UvicornThread()
    engine_port = thread.serve(FakeOpenAIBackend(["engine-model"]))
    port = thread.serve(api.app.asgi)
    try:
        yield api, port, engine_port
    finally:
        thread.call(api.app.gateway.aclose())
        thread.stop()


def _new_service(api: Api, engine_port: int) -> dict[str, Any]:
    """A service just created: its one replica pending, its route in the snapshot."""
    admin = api.login()
    node = api.heartbeat()
    body = service_body(
        model_name="chat", task={"ports": [{"container_port": 8080, "host_port": engine_port}]}
    )
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    g: dict[str, Any] = r.json()
    g["node"] = node
    api.app.publisher.refresh()
    return g


def _report(api: Api, g: dict[str, Any], status: str) -> None:
    task_id = g["tasks"][0]["id"]
    r = api.agent_post(g["node"], f"/api/v1/agent/tasks/{task_id}/report", {"status": status})
    assert r.status_code == 200, r.text


def _claim(api: Api, g: dict[str, Any]) -> None:
    api.app.scheduler.run_round()
    task_id = g["tasks"][0]["id"]
    r = api.agent_post(g["node"], f"/api/v1/agent/tasks/{task_id}/claim", {})
    assert r.status_code == 200, r.text


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


def _post(port: int, key: str) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"model": "chat", "messages": MSG},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


@pytest.mark.feature("M17")
def test_a_request_sent_while_the_replica_starts_is_answered_once_it_is_up(
    live: tuple[Api, int, int],
) -> None:
    api, port, engine_port = live
    g = _new_service(api, engine_port)
    (target,) = api.app.holder.current.routes[g["tenant_id"], "chat"]
    assert target.backends == () and target.starting == 1
    assert target.starting_since == api.clock.now().timestamp()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=g["api_key"], max_retries=0
    )
    try:
        waiting, out = _in_thread(
            lambda: client.chat.completions.create(model="chat", messages=MSG)
        )
        time.sleep(0.5)  # held, not refused: pending, then placed, claimed, loading
        assert waiting.is_alive()
        _claim(api, g)
        time.sleep(0.3)
        assert waiting.is_alive()
        _report(api, g, "running")  # its first health check passed
        waiting.join(10)
        assert not waiting.is_alive()
        (answer,) = out
        assert not isinstance(answer, Exception), answer
        assert answer.choices[0].message.content
    finally:
        client.close()
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'heteroflow_gateway_start_holds_total{model="chat",outcome="ready"} 1' in metrics
    assert "heteroflow_gateway_wakes_total{" not in metrics  # nothing was woken


@pytest.mark.feature("M17")
def test_held_too_long_the_answer_says_how_long_the_replicas_have_been_starting(
    live: tuple[Api, int, int],
) -> None:
    api, port, engine_port = live
    g = _new_service(api, engine_port)
    _claim(api, g)
    api.clock.advance(95)  # loading a big model
    api.app.gateway.hold.start_hold_s = 0.3  # HETEROFLOW_GATEWAY_START_HOLD_S
    t0 = time.monotonic()
    r = _post(port, g["api_key"])
    assert 0.3 <= time.monotonic() - t0 < 5
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(api.app.settings.gateway_wake_retry_after_s)
    err = r.json()["error"]
    assert err["code"] == "model_starting"
    assert "has 1 replica starting (for 95 s) and none was ready within 0.3 s" in (
        err["message"]
    )


def test_a_service_whose_replicas_all_failed_is_refused_at_once(
    live: tuple[Api, int, int],
) -> None:
    api, port, engine_port = live
    g = _new_service(api, engine_port)
    _claim(api, g)
    _report(api, g, "failed")
    api.app.publisher.refresh()
    (target,) = api.app.holder.current.routes[g["tenant_id"], "chat"]
    assert target.starting == 0 and target.backends == ()
    t0 = time.monotonic()
    r = _post(port, g["api_key"])
    assert time.monotonic() - t0 < 2  # not held for gateway_start_hold_s
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_backend"
