"""The server's /metrics and the management API's request ids (P3), on the real app.

One scrape of the server's port shows the in-process gateway's series and the server's:
API latency by route template (never an id), a scheduling round that ran through the
shared controller loop, the leader, nodes and tasks by status (cached between scrapes).
Every API answer carries an ``x-request-id`` — the caller's, or a new one — and the lines
logged while answering carry it too.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from heteroflow.controllers.base import run_tick
from heteroflow.logs import make_handler
from tests.integration.conftest import Api, service_body

_SAMPLE = re.compile(r"^(.+) (\S+)$")  # label values may hold spaces


def scrape(api: Api) -> tuple[str, dict[str, float]]:
    r = api.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            out[m[1]] = float(m[2])
    return r.text, out


@pytest.mark.feature("P3")
def test_one_scrape_shows_the_gateway_and_the_server(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    assert r.status_code == 201, r.text
    group_id = r.json()["id"]
    assert api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).status_code == 200
    assert api.client.get("/api/v1/task-groups/tg-nope", headers=admin).status_code == 404
    assert api.client.get("/api/v1/no-such-thing").status_code == 404
    app = api.app
    # one scheduling round, as the server's loop runs it
    assert run_tick(app.scheduler, app.leadership, api.clock.now(), app.metrics)
    text, s = scrape(api)

    assert "heteroflow_gateway_in_flight" in s  # the gateway's series are still there
    h = "heteroflow_server_api_request_duration_seconds_count"
    assert s[f'{h}{{method="POST",route="/api/v1/auth/login",code="2xx"}}'] == 1
    one = 'method="GET",route="/api/v1/task-groups/{group_id}"'
    assert s[f'{h}{{{one},code="2xx"}}'] == 1
    assert s[f'{h}{{{one},code="4xx"}}'] == 1
    assert s[f'{h}{{method="GET",route="other",code="4xx"}}'] == 1
    assert group_id not in text and "tg-nope" not in text  # templates, never ids

    assert s['heteroflow_server_controller_rounds_total{controller="scheduler"}'] == 1
    assert s["heteroflow_server_scheduler_placed_total"] == 1
    assert s["heteroflow_server_scheduler_decision_seconds_count"] == 1
    assert s["heteroflow_server_scheduler_waiting_tasks"] == 0
    assert s['heteroflow_server_nodes{status="online"}'] == 1
    assert s['heteroflow_server_tasks{status="scheduled"}'] == 1
    assert s['heteroflow_server_tasks{status="pending"}'] == 0
    me = app.leadership.holder
    assert s[f'heteroflow_server_leader{{instance="{me}"}}'] == 0  # no election round yet
    app.leadership.reconcile_once(api.clock.now())
    _, s = scrape(api)
    assert s[f'heteroflow_server_leader{{instance="{me}"}}'] == 1
    assert s[f'heteroflow_server_leader_epoch{{instance="{me}"}}'] >= 1


@pytest.mark.feature("P3")
def test_fleet_gauges_are_cached_between_scrapes(api: Api) -> None:
    api.heartbeat("node-a")
    _, s = scrape(api)
    assert s['heteroflow_server_nodes{status="online"}'] == 1
    api.heartbeat("node-b")
    _, s = scrape(api)
    assert s['heteroflow_server_nodes{status="online"}'] == 1  # not read again yet
    api.clock.advance(api.app.settings.metrics_fleet_refresh_s)
    _, s = scrape(api)
    assert s['heteroflow_server_nodes{status="online"}'] == 2


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The process's JSON handler on the root logger, as `HETEROFLOW_LOG_FORMAT=json`."""
    out = io.StringIO()
    handler = make_handler("json", out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)


@pytest.mark.feature("P3")
def test_every_api_answer_echoes_a_request_id_that_its_log_lines_carry(
    api: Api, json_log: io.StringIO
) -> None:
    fastapi_app = api.app.asgi.api
    logger = logging.getLogger("heteroflow.test_request_ids")
    logger.setLevel(logging.INFO)

    def noisy() -> dict[str, str]:  # a sync route: it runs in a worker thread
        logger.info("answering with Bearer %s", "tok-123456789")
        return {"ok": "yes"}

    fastapi_app.add_api_route("/api/v1/test-noisy", noisy)
    r = api.client.get("/api/v1/test-noisy", headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    fresh = api.client.get("/healthz")
    assert re.fullmatch(r"req_[0-9a-f]{32}", fresh.headers["x-request-id"])
    bad = api.client.get("/healthz", headers={"X-Request-Id": "x" * 200})
    assert bad.headers["x-request-id"].startswith("req_")
    # errors too, and the request ids of two answers differ
    missing = api.client.get("/api/v1/task-groups/tg-nope")
    assert missing.status_code == 401
    assert missing.headers["x-request-id"] not in (fresh.headers["x-request-id"], "trace-42")
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    mine = [x for x in lines if x["logger"] == "heteroflow.test_request_ids"]
    assert mine == [
        {
            "time": mine[0]["time"],
            "level": "INFO",
            "logger": "heteroflow.test_request_ids",
            "message": "answering with Bearer ***",
            "request_id": "trace-42",
        }
    ]
