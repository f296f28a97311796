"""The heartbeat without the framework (api/heartbeat_fast.py): a success is answered
before FastAPI, with the request id echoed and the latency counted under the route;
everything else — a refusal, a failure, a body too large to hold — reaches the API whole
and gets the API's own answer (test_heartbeat_writes.py compares every refusal with the
declared route through the same dispatcher)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.api import heartbeat_fast
from heteroflow.db.tables import Node

from .conftest import NODE_TOKEN, Api
from .test_heartbeat_writes import beat, node_updates

PATH = heartbeat_fast.PATH
AUTH = {"Authorization": f"Bearer {NODE_TOKEN}", "content-type": "application/json"}


@pytest.fixture
def api_calls(api: Api) -> list[str]:
    """The paths of the requests that reached the API's framework."""
    dispatcher: Any = api.app.asgi
    calls: list[str] = []
    inner = dispatcher.api

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            calls.append(scope["path"])
        await inner(scope, receive, send)

    dispatcher.api = spy
    dispatcher.fast[("POST", PATH)].api = spy
    return calls


def heartbeats_counted(api: Api, status_class: str) -> int:
    h = api.app.metrics.api.get(("POST", PATH, status_class))
    return 0 if h is None else h.count


@pytest.mark.feature("P1")
def test_a_heartbeat_is_answered_before_the_framework(api: Api, api_calls: list[str]) -> None:
    r = api.client.post(PATH, content=json.dumps(beat(name="fast")),
                        headers={**AUTH, "x-request-id": "req-from-agent"})
    assert r.status_code == 200 and r.json()["tasks"] == []
    assert r.headers["x-request-id"] == "req-from-agent"
    assert r.headers["content-type"] == "application/json"
    assert api_calls == []  # FastAPI never saw it
    assert heartbeats_counted(api, "2xx") == 1
    r = api.client.post(PATH, content=json.dumps(beat(name="fast")), headers=AUTH)
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
    with api.app.db.session() as s:
        assert s.scalars(select(Node.name)).all() == ["fast"]


def test_a_refused_heartbeat_gets_the_apis_own_answer(api: Api, api_calls: list[str]) -> None:
    bad = api.client.post(PATH, content=json.dumps(beat()),
                          headers={**AUTH, "Authorization": "Bearer guess"})
    assert bad.status_code == 401 and api_calls == [PATH]
    assert bad.headers["x-request-id"].startswith("req_")  # the API's own middleware
    invalid = api.client.post(PATH, content=b'{"name": 1}', headers=AUTH)
    assert invalid.status_code == 400 and api_calls == [PATH, PATH]
    assert "name" in json.dumps(invalid.json())  # the API's validation answer
    assert heartbeats_counted(api, "2xx") == 0
    assert heartbeats_counted(api, "4xx") == 2  # counted once each, by the API


def test_a_body_larger_than_the_fast_path_holds_reaches_the_api_whole(
    api: Api, api_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heartbeat_fast, "MAX_FAST_BODY", 64)
    body = json.dumps(beat(name="large")).encode()
    assert len(body) > 64
    chunks = iter([body[:40], body[40:100], body[100:]])
    r = api.client.post(PATH, content=chunks, headers=AUTH)  # streamed in three parts
    assert r.status_code == 200 and api_calls == [PATH]
    with api.app.db.session() as s:
        assert s.scalars(select(Node.name)).all() == ["large"]


def test_a_heartbeat_that_fails_is_handed_to_the_api(
    api: Api, api_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatcher: Any = api.app.asgi
    fast = dispatcher.fast[("POST", PATH)]
    real, failures = fast.work, list[int]()

    def flaky(ctx: Any, beats: Any) -> list[bytes | None]:
        if not failures:
            failures.append(1)
            raise ConnectionError("the database went away for a moment")
        return list(real(ctx, beats))

    monkeypatch.setattr(fast, "work", flaky)
    r = api.client.post(PATH, content=json.dumps(beat(name="again")), headers=AUTH)
    assert r.status_code == 200 and api_calls == [PATH]  # the API's own try succeeded
    with api.app.db.session() as s:
        assert s.scalars(select(Node.name)).all() == ["again"]


def post_together(
    api: Api, bodies: list[dict[str, Any]]
) -> tuple[list[threading.Thread], list[Any]]:
    """Heartbeats sent at once, each from its own thread: the threads, and the answers
    they fill in."""
    answers: list[Any] = [None] * len(bodies)

    def one(i: int) -> None:
        answers[i] = api.client.post(PATH, content=json.dumps(bodies[i]), headers=AUTH)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, answers


def test_beats_that_arrive_together_are_refreshed_as_one_batch(api: Api) -> None:
    """While the heartbeat threads are busy, the beats that arrive wait together and the
    next free thread takes them all: one read and one UPDATE statement for the batch,
    and still each node gets its own reply and its own row."""
    fast: Any = api.app.asgi.fast[("POST", PATH)]
    real, batches, gate = fast.work, list[list[str]](), threading.Event()

    def held(ctx: Any, beats: Any) -> Any:
        batches.append([json.loads(b.body)["name"] for b in beats])
        assert gate.wait(20)  # the first batches wait while the rest arrive
        return real(ctx, beats)

    fast.work = held
    names = [f"n{i:02d}" for i in range(12)]
    gate.set()
    ids = {n: api.client.post(PATH, content=json.dumps(beat(name=n)), headers=AUTH).json()[
        "node_id"] for n in names}
    gate.clear()
    batches.clear()
    bodies = [beat(name=n, inventory={**beat()["inventory"], "memory_available_mb": 1000 + i})
              for i, n in enumerate(names)]
    first, rest = heartbeat_fast.WORKERS, len(names) - heartbeat_fast.WORKERS

    def until(what: Any) -> None:
        deadline = time.monotonic() + 20
        while not what():
            assert time.monotonic() < deadline, (batches, len(fast._waiting))
            time.sleep(0.01)

    sent: list[tuple[list[threading.Thread], list[Any]]] = []
    with node_updates(api) as updates:
        for i in range(first):  # one beat at a time: each thread held with one...
            sent.append(post_together(api, bodies[i:i + 1]))
            until(lambda i=i: len(batches) == i + 1)
        sent.append(post_together(api, bodies[first:]))  # ...while the rest wait
        until(lambda: len(fast._waiting) == rest)
        gate.set()
        for threads, _ in sent:
            for t in threads:
                t.join(20)
    answers = [a for _, part in sent for a in part]
    # the beats that waited were taken in one batch by the first thread set free
    assert [len(b) for b in batches] == [1] * first + [rest]
    assert sorted(n for b in batches for n in b) == names
    for body, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200
        assert answer.json() == {"node_id": ids[body["name"]], "tasks": []}
    assert len(updates) == len(batches)  # one UPDATE statement per batch
    with api.app.db.session() as s:
        stored = {n: m for n, m in s.execute(select(Node.name, Node.memory_available_mb))}
    assert stored == {n: 1000 + i for i, n in enumerate(names)}
