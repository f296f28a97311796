"""The heartbeat's hot path (issue 18, item 3): what it writes, and that it answers as
the FastAPI route it replaced did.

``services.nodes.heartbeat`` writes only the columns that changed (the steady JSON ones
compared with the stored text) and ``api.routes.nodes.heartbeat`` reads the body in one
trip to the thread pool. Neither may change what is stored or what a caller is told:
the first group checks the row after each beat and the statements sent; the second sends
the same requests to the route as FastAPI declares it (body model, session and token
dependencies) and to the real app, and compares the answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event, select, update

from heteroflow.api import errors
from heteroflow.api.deps import DB, AgentNode, Ctx
from heteroflow.api.heartbeat_fast import Beat
from heteroflow.api.routes.nodes import heartbeat_work
from heteroflow.db.tables import Node
from heteroflow.schemas.nodes import Heartbeat, HeartbeatReply
from heteroflow.services.agents import nodes

from .conftest import NODE_TOKEN, Api

AUTH = {"Authorization": f"Bearer {NODE_TOKEN}"}
CARD = {"index": 0, "memory_total_mb": 81559, "model": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-0", "temperature_c": 40, "memory_used_mb": 100, "source": "nvml"}
CARD1 = {**CARD, "index": 1, "uuid": "GPU-1"}
MODEL = {"name": "llama-8b", "path": "/data/models/llama-8b", "format": "hf",
         "size_bytes": 16 << 30, "files": ["config.json", "model.safetensors"], "mtime": 1.7e9}


def beat(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "node-w",
        "address": "10.0.0.7",
        "runtime": "docker",
        "inventory": {"gpus": [CARD], "cpu_count": 64, "memory_total_mb": 262144,
                      "memory_available_mb": 200000, "cpu_percent": 12.5},
        "labels": {"zone": "a"},
        "engines": {"vllm": "vllm/vllm-openai:v0.11.0"},
        "models": [MODEL],
        "allowed_volume_prefixes": ["/data/models"],
        "host_ports_in_use": [22, 9100],
    }
    body.update(over)
    return body


def send(api: Api, body: dict[str, Any]) -> str:
    r = api.client.post("/api/v1/agent/heartbeat", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def stored(api: Api, node_id: str) -> dict[str, Any]:
    with api.app.db.session() as s:
        n = s.get(Node, node_id)
        assert n is not None
        return {c: getattr(n, c) for c in (*nodes.STEADY_COLUMNS, "gpus", "address",
                                           "memory_available_mb", "cpu_percent",
                                           "last_heartbeat_at", "registered_at")}


def expected(body: dict[str, Any]) -> dict[str, Any]:
    """The row a heartbeat with this body leaves (``reported_columns``)."""
    return nodes.reported_columns(Heartbeat.model_validate(body))


@contextmanager
def node_updates(api: Api) -> Iterator[list[str]]:
    """The SQL of every UPDATE of the nodes table sent meanwhile."""
    seen: list[str] = []

    def note(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE NODES"):
            seen.append(statement)

    event.listen(api.app.db.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(api.app.db.engine, "before_cursor_execute", note)


def set_columns(statement: str) -> set[str]:
    head = statement.split(" WHERE ")[0].split(" SET ", 1)[1]
    return {part.split("=")[0].strip() for part in head.split(", ")}


def test_each_beat_leaves_exactly_what_it_reported(api: Api) -> None:
    first = beat()
    node_id = send(api, first)
    row = stored(api, node_id)
    assert {k: row[k] for k in nodes.STEADY_COLUMNS} == {
        k: expected(first)[k] for k in nodes.STEADY_COLUMNS
    }
    assert row["registered_at"] == row["last_heartbeat_at"] == api.clock.now()
    registered = row["registered_at"]
    steps = [
        beat(),  # nothing changed
        beat(models=[MODEL, {**MODEL, "name": "qwen-7b", "path": "/data/models/qwen-7b"}]),
        beat(host_ports_in_use=[9100, 22, 22, 8080]),  # the server keeps them sorted, once
        beat(labels={"zone": "b", "rdma": "true"}, engines={}),
        beat(allowed_volume_prefixes=[], denied_volume_prefixes=["/data/models/private"]),
        beat(address="10.0.0.8", inventory={"gpus": [{**CARD, "temperature_c": 77}],
                                            "memory_available_mb": 1000}),
        beat(models=[]),
    ]
    for body in steps:
        api.clock.advance(5)
        assert send(api, body) == node_id
        row = stored(api, node_id)
        want = expected(body)
        for k in (*nodes.STEADY_COLUMNS, "gpus", "address", "memory_available_mb"):
            assert row[k] == want[k], k
        assert row["last_heartbeat_at"] == api.clock.now()
        assert row["registered_at"] == registered


def test_a_steady_beat_rewrites_none_of_the_large_columns(api: Api) -> None:
    node_id = send(api, beat())
    api.clock.advance(5)
    with node_updates(api) as updates:
        send(api, beat())  # same cards, models, ports...
    assert len(updates) == 1
    assert set_columns(updates[0]) == {
        "address", "runtime", "cpu_count", "memory_total_mb", "memory_available_mb",
        "cpu_percent", "memory_percent", "last_heartbeat_at", "peer_url",  # all small
    }
    api.clock.advance(5)
    moved = beat(models=[], inventory={"gpus": [{**CARD, "memory_used_mb": 9000}]})
    with node_updates(api) as updates:
        send(api, moved)
    assert {"models", "gpus"} <= set_columns(updates[0])
    assert not {"labels", "engines", "host_ports_in_use"} & set_columns(updates[0])
    assert stored(api, node_id)["models"] == []


def test_a_value_written_by_someone_else_is_overwritten_by_the_next_beat(api: Api) -> None:
    """A launch that found pool ports taken adds them to the node's ports until its next
    heartbeat (P2): that beat carries the same list as the one before, and must still
    replace what is stored — the comparison is with the row, not with the last beat."""
    node_id = send(api, beat())
    with api.app.db.session() as s:
        s.execute(update(Node).where(Node.id == node_id).values(
            host_ports_in_use=[22, 9100, 21003], models=[], labels={"x": "y"}))
    api.clock.advance(5)
    send(api, beat())
    row = stored(api, node_id)
    assert row["host_ports_in_use"] == [22, 9100]
    assert row["models"] == expected(beat())["models"]
    assert row["labels"] == {"zone": "a"}


def test_a_card_gone_from_the_inventory_is_still_noticed(api: Api) -> None:
    node_id = send(api, beat(inventory={"gpus": [CARD, CARD1]}))
    api.clock.advance(5)
    send(api, beat())  # card 1 vanished: no task on it, so no event, but the row moves on
    assert [g["index"] for g in stored(api, node_id)["gpus"]] == [0]


# -- a batch of beats (services.nodes.refresh_many, routes.nodes.heartbeat_work) -------
def refresh(api: Api, *bodies: dict[str, Any]) -> list[HeartbeatReply | None]:
    """``refresh_many`` on one batch of these bodies, as the fast path's thread runs it."""
    with api.app.db.autocommit() as conn:
        return nodes.refresh_many(
            conn, api.clock, [Heartbeat.model_validate(b) for b in bodies])


def as_beat(api: Api, body: bytes, token: str = NODE_TOKEN) -> Beat:
    """A heartbeat request as the fast path hands it to ``heartbeat_work``."""
    fast: Any = api.app.asgi.fast[("POST", "/api/v1/agent/heartbeat")]
    headers = [(b"content-type", b"application/json"),
               (b"authorization", f"Bearer {token}".encode())]
    return Beat({"type": "http", "app": fast.app, "headers": headers}, body, "req_test")


def test_of_two_beats_of_one_node_in_a_batch_the_later_is_stored(api: Api) -> None:
    """The earlier beat's change must not land after the later one's: the later beat
    equals the stored row, so it writes no models, and the earlier (which would) writes
    nothing at all."""
    node_id = send(api, beat())
    api.clock.advance(5)
    replies = refresh(api, beat(models=[]), beat())
    assert [r.node_id if r else None for r in replies] == [node_id, node_id]
    row = stored(api, node_id)
    assert row["models"] == expected(beat())["models"]
    assert row["last_heartbeat_at"] == api.clock.now()


def test_an_earlier_beat_that_lost_a_card_does_not_land_after_the_later_one(api: Api) -> None:
    """Card 1 gone in the earlier beat and back in the later: the later (the node's
    state) is what stays, not the earlier's transaction run after it."""
    node_id = send(api, beat(inventory={"gpus": [CARD, CARD1]}))
    api.clock.advance(5)
    earlier, later = beat(), beat(inventory={"gpus": [CARD, CARD1]})  # card 1 missing, back
    replies = refresh(api, earlier, later)
    assert [r.node_id if r else None for r in replies] == [node_id, node_id]
    assert [g["index"] for g in stored(api, node_id)["gpus"]] == [0, 1]
    replies = refresh(api, later, earlier)  # the later one lost it: that one takes the
    assert replies[0] is not None and replies[1] is None  # transaction


def test_a_batch_leaves_a_new_node_and_a_lost_card_to_the_transaction(api: Api) -> None:
    two = send(api, beat(name="two", inventory={"gpus": [CARD, CARD1]}))
    steady = send(api, beat(name="steady"))
    api.clock.advance(5)
    bodies = [beat(name="new"), beat(name="two"),
              beat(name="steady", inventory={**beat()["inventory"], "memory_available_mb": 5})]
    replies = refresh(api, *bodies)
    assert replies[:2] == [None, None]
    assert replies[2] is not None and replies[2].node_id == steady
    assert len(stored(api, two)["gpus"]) == 2  # left as it was for the transaction
    with api.app.db.session() as s:
        assert "new" not in s.scalars(select(Node.name)).all()
    # the whole batch through the route's work: each beat answered, each written
    beats = [as_beat(api, json.dumps(b).encode()) for b in bodies]
    answers = [HeartbeatReply.model_validate_json(a or b"") for a in
               heartbeat_work(api.app.ctx, beats)]
    assert [a.node_id for a in answers][1:] == [two, steady]
    assert [g["index"] for g in stored(api, two)["gpus"]] == [0]
    assert stored(api, steady)["memory_available_mb"] == 5
    with api.app.db.session() as s:
        assert s.scalar(select(Node.id).where(Node.name == "new")) == answers[0].node_id


def test_a_beat_the_route_must_answer_does_not_stop_the_rest_of_its_batch(api: Api) -> None:
    steady = send(api, beat(name="steady"))
    answers = heartbeat_work(api.app.ctx, [
        as_beat(api, json.dumps(beat(name="steady")).encode(), token="guess"),
        as_beat(api, b'{"name": 1}'),
        as_beat(api, json.dumps(beat(name="steady")).encode()),
    ])
    assert answers[:2] == [None, None]
    assert answers[2] is not None
    assert HeartbeatReply.model_validate_json(answers[2]).node_id == steady


# -- the answers: the declared FastAPI route against the real one ----------------------
def declared_route(api: Api) -> TestClient:
    """The heartbeat route as FastAPI declares it, on the same context, token check and
    error handlers: what the real route's answers must equal."""
    ref = FastAPI()
    errors.install(ref)
    ref.state.ctx = api.app.ctx
    ref.state.node_tokens = api.app.node_tokens

    @ref.post("/api/v1/agent/heartbeat", response_model=HeartbeatReply)
    def heartbeat(hb: Heartbeat, ctx: Ctx, s: DB, _node: AgentNode) -> HeartbeatReply:
        return nodes.heartbeat(s, ctx.clock, hb)

    return TestClient(ref)


JSON = {"content-type": "application/json"}
BAD = {"Authorization": "Bearer guess"}
VALID = beat(name="node-ref")
CASES: list[tuple[str, dict[str, str], bytes | None]] = [
    ("valid", {**AUTH, **JSON}, None),
    ("json with a charset", {**AUTH, "content-type": "application/json; charset=utf-8"}, None),
    ("a +json type", {**AUTH, "content-type": "application/vnd.agent+json"}, None),
    ("no content type", AUTH, None),
    ("text/plain", {**AUTH, "content-type": "text/plain"}, None),
    ("empty", {**AUTH, **JSON}, b""),
    ("not json", {**AUTH, **JSON}, b'{"name": '),
    ("a list", {**AUTH, **JSON}, b"[]"),
    ("null", {**AUTH, **JSON}, b"null"),
    ("NaN", {**AUTH, **JSON},
     b'{"name":"n","address":"a","inventory":{"cpu_percent":NaN}}'),
    ("64-bit count", {**AUTH, **JSON},
     b'{"name":"n","address":"a","inventory":{"cpu_count":1099511627776}}'),
    ("float for int", {**AUTH, **JSON},
     b'{"name":"n","address":"a","inventory":{"cpu_count":2.0}}'),
    ("unknown field", {**AUTH, **JSON}, b'{"name":"n","address":"a","inventory":{},"x":1}'),
    ("lone surrogate", {**AUTH, **JSON},
     b'{"name":"n","address":"a","inventory":{},"models":[{"name":"a\\udc80"}]}'),
    ("NUL", {**AUTH, **JSON}, b'{"name":"n","address":"a\\u0000","inventory":{}}'),
    ("bad token", {**BAD, **JSON}, None),
    ("bad token, empty object", {**BAD, **JSON}, b"{}"),
    ("bad token, not json", {**BAD, **JSON}, b"{"),
    ("bad token, not json, text", {**BAD, "content-type": "text/plain"}, b"{"),
    ("no token", JSON, None),
]


@pytest.mark.parametrize(("case", "headers", "body"), CASES, ids=[c[0] for c in CASES])
def test_answers_are_those_of_the_declared_route(
    api: Api, case: str, headers: dict[str, str], body: bytes | None
) -> None:
    content = json.dumps(VALID).encode() if body is None else body
    ref = declared_route(api).post("/api/v1/agent/heartbeat", content=content,
                                   headers=headers)
    real = api.client.post("/api/v1/agent/heartbeat", content=content, headers=headers)
    assert (real.status_code, real.json()) == (ref.status_code, ref.json()), case
    if real.status_code == 200:
        with api.app.db.session() as s:
            assert s.scalars(select(Node.name)).all() == ["node-ref"]  # one node, updated
