"""The ``heteroflow models`` verbs' API (issue 29, H9) through the real app and database:
operators only, a pull takes a source, one open request per node and source, the agent's
claim and report, lost and offline requests, one node-level event per end — and the
agent's own round (``agent.model_requests``, with the real ``ServerClient`` over the ASGI
app, the real ``ModelCache`` and the stand-in hub ``testing.model_hub``) pulling, refusing
to evict a model in use, evicting it once released, its token in no message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import httpx
import pytest
from aiohttp.test_utils import TestServer
from pydantic import SecretStr
from sqlalchemy import select

from heteroflow.agent.client import ServerClient
from heteroflow.agent.model_cache import ModelCache
from heteroflow.agent.model_requests import ModelRequests
from heteroflow.agent.state import AgentState
from heteroflow.core.model_sources import parse_model_source
from heteroflow.db.tables import Event
from heteroflow.schemas.model_requests import ModelRequestReport
from heteroflow.settings import AgentSettings
from heteroflow.testing.model_hub import COMMIT, ModelHub, Repo

from .conftest import NODE_TOKEN, Api

TOKEN = "hf_pullSECRETtoken0123456789"
WEIGHTS = bytes(range(256)) * 512  # 128 KiB
CONFIG = b'{"model_type": "llama"}'
PULL = "/api/v1/nodes/{}/models/pull"
EVICT = "/api/v1/nodes/{}/models/evict"


def beat(api: Api, name: str = "node-a", cache: list[dict[str, Any]] | None = None,
         peer_url: str = "") -> str:
    """A heartbeat of node ``name`` that reports ``cache`` as its model cache."""
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name, "address": "127.0.0.1", "runtime": "process",
            "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 8192,
                          "memory_available_mb": 8192},
            "model_cache": cache or [], "peer_url": peer_url,
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def agent_get(api: Api, node_id: str, held: list[str] | None = None) -> list[dict[str, Any]]:
    r = api.client.get(
        "/api/v1/agent/model-requests", params={"held": held or []},
        headers={"Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node_id},
    )
    assert r.status_code == 200, r.text
    return list(r.json())


def node_events(api: Api, node_id: str) -> list[Event]:
    with api.app.db.session() as s:
        return list(s.scalars(
            select(Event).where(Event.node_id == node_id, Event.group_id.is_(None),
                                Event.kind.like("node.%")).order_by(Event.id)
        ))


@pytest.mark.feature("H9")
def test_only_an_operator_lists_pulls_evicts_or_reads(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team", "alice")
    beat(api)
    asked = api.client.post(PULL.format("node-a"), json={"source": "hf://org/tiny"},
                            headers=admin).json()
    for method, path, body in (
        ("GET", "/api/v1/models/cache", None),
        ("POST", PULL.format("node-a"), {"source": "hf://org/tiny"}),
        ("POST", EVICT.format("node-a"), {"key": "hf--org--tiny--0123456789abcdef"}),
        ("GET", f"/api/v1/model-requests/{asked['id']}", None),
    ):
        r = api.client.request(method, path, json=body, headers=member)
        assert r.status_code == 403, (path, r.text)
        assert "operator" in r.json()["error"]["message"]
        assert api.client.request(method, path, json=body).status_code == 401


@pytest.mark.feature("H9")
@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("/models/qwen", "is a path: a pull takes a model source"),
        ("qwen.gguf", "is a path"),
        ("ftp://host/x.gguf", "unknown scheme"),
        ("https://user:pw@host/x.gguf", "user info"),
        ("https://host/x.gguf?sig=abc", "query string"),
        ("hf://just-a-name", "org/name"),
        ("http://example.com/x.gguf", "loopback"),
    ],
)
def test_a_pull_takes_a_source_and_names_the_field(api: Api, source: str, words: str) -> None:
    admin = api.login()
    beat(api)
    r = api.client.post(PULL.format("node-a"), json={"source": source}, headers=admin)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == "source" and words in err["message"], err


def test_bodies_and_nodes_that_do_not_fit(api: Api) -> None:
    admin = api.login()
    beat(api)
    for body in ({}, {"source": 1}, {"source": "hf://org/tiny", "node": "x"}):
        assert api.client.post(PULL.format("node-a"), json=body,
                               headers=admin).status_code in (400, 422)
    for key in ("..", ".trash", "a/b", "", "x" * 121):
        r = api.client.post(EVICT.format("node-a"), json={"key": key}, headers=admin)
        assert r.status_code in (400, 422), (key, r.text)
    r = api.client.post(PULL.format("nowhere"), json={"source": "hf://org/tiny"}, headers=admin)
    assert r.status_code == 404 and "nowhere" in r.json()["error"]["message"]
    assert api.client.get("/api/v1/models/cache?node=nowhere", headers=admin).status_code == 404
    assert api.client.get("/api/v1/model-requests/mrq-000000000000",
                          headers=admin).status_code == 404


@pytest.mark.feature("H9")
def test_a_second_pull_of_the_same_source_answers_the_first(api: Api) -> None:
    admin = api.login()
    node_id = beat(api)
    beat(api, "node-b")
    first = api.client.post(PULL.format("node-a"), json={"source": "hf://org/tiny"},
                            headers=admin)
    assert first.status_code == 202, first.text
    mr = first.json()
    assert mr["status"] == "pending" and mr["id"].startswith("mrq-") and mr["node"] == "node-a"
    assert mr["source"] == "hf://org/tiny@main"  # the canonical text, as the cache keys it
    # by id or by name; the same source written differently is the same source
    again = api.client.post(PULL.format(node_id), json={"source": "hf://org/tiny@main"},
                            headers=admin).json()
    assert again["id"] == mr["id"]
    other = api.client.post(PULL.format("node-b"), json={"source": "hf://org/tiny"},
                            headers=admin).json()
    assert other["id"] != mr["id"]
    # claimed: still the one open request (running now)
    claimed = agent_get(api, node_id)
    assert [c["id"] for c in claimed] == [mr["id"]] and claimed[0]["action"] == "pull"
    again = api.client.post(PULL.format("node-a"), json={"source": "hf://org/tiny"},
                            headers=admin).json()
    assert again["id"] == mr["id"] and again["status"] == "running"
    assert agent_get(api, node_id, [mr["id"]]) == []  # claimed once only
    done = api.agent_post(node_id, f"/api/v1/agent/model-requests/{mr['id']}",
                          {"status": "done", "message": "held", "key": "hf--org--tiny--x"})
    assert done.status_code == 200, done.text
    fresh = api.client.post(PULL.format("node-a"), json={"source": "hf://org/tiny"},
                            headers=admin).json()
    assert fresh["id"] != mr["id"] and fresh["status"] == "pending"


def test_the_agent_reports_progress_then_its_end_once(api: Api) -> None:
    admin = api.login()
    node_id = beat(api)
    other = beat(api, "node-b")
    mr = api.client.post(EVICT.format("node-a"), json={"key": "hf--org--tiny--1"},
                         headers=admin).json()
    agent_get(api, node_id)
    path = f"/api/v1/agent/model-requests/{mr['id']}"
    assert api.agent_post(other, path, {"status": "running"}).status_code == 404
    r = api.agent_post(node_id, path, {"status": "running", "message": "removing",
                                       "done_bytes": 5, "total_bytes": 10})
    assert r.status_code == 200, r.text
    got = api.client.get(f"/api/v1/model-requests/{mr['id']}", headers=admin).json()
    assert (got["status"], got["message"], got["done_bytes"], got["total_bytes"]) == (
        "running", "removing", 5, 10)
    r = api.agent_post(node_id, path, {"status": "failed", "message": "model in use"})
    assert r.status_code == 200 and r.json()["status"] == "failed"
    assert api.agent_post(node_id, path, {"status": "done"}).status_code == 409
    assert api.agent_post(node_id, path, {"status": "pending"}).status_code in (400, 422)
    got = api.client.get(f"/api/v1/model-requests/{mr['id']}", headers=admin).json()
    assert got["status"] == "failed" and got["message"] == "model in use"
    [ev] = node_events(api, node_id)
    assert ev.kind == "node.model_request_failed" and ev.to_status == "failed"
    assert "eviction of hf--org--tiny--1 on node node-a failed" in ev.message
    assert mr["id"] in ev.message and "model in use" in ev.message


def test_a_request_the_agent_lost_or_whose_node_went_away_fails(api: Api) -> None:
    admin = api.login()
    node_id = beat(api)
    lost = api.client.post(PULL.format("node-a"), json={"source": "hf://org/a"},
                           headers=admin).json()
    kept = api.client.post(PULL.format("node-a"), json={"source": "hf://org/b"},
                           headers=admin).json()
    assert len(agent_get(api, node_id)) == 2
    agent_get(api, node_id, [kept["id"]])  # the agent restarted: it holds only one
    got = api.client.get(f"/api/v1/model-requests/{lost['id']}", headers=admin).json()
    assert got["status"] == "failed" and "no longer works on it" in got["message"]
    assert api.client.get(f"/api/v1/model-requests/{kept['id']}",
                          headers=admin).json()["status"] == "running"
    # the node stops heartbeating: its open request fails when read, a new one is refused
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    got = api.client.get(f"/api/v1/model-requests/{kept['id']}", headers=admin).json()
    assert got["status"] == "failed" and "went offline" in got["message"]
    r = api.client.post(PULL.format("node-a"), json={"source": "hf://org/c"}, headers=admin)
    assert r.status_code == 409 and "offline" in r.json()["error"]["message"]
    kinds = [e.kind for e in node_events(api, node_id)]
    assert kinds == ["node.model_request_failed"] * 2


def test_the_cache_list_is_every_node_s_heartbeat(api: Api) -> None:
    admin = api.login()
    entry = {"key": "hf--org--tiny--abc", "source": "hf://org/tiny@main",
             "revision": COMMIT, "size_bytes": 1234, "state": "complete"}
    beat(api, "node-b", [entry, {**entry, "key": "url--h-x.gguf--def",
                                 "source": "https://h/x.gguf", "revision": "",
                                 "state": "downloading", "size_bytes": 5}])
    beat(api, "node-a", [entry])
    rows = api.client.get("/api/v1/models/cache", headers=admin).json()
    assert [(r["node"], r["key"], r["state"]) for r in rows] == [
        ("node-a", "hf--org--tiny--abc", "complete"),
        ("node-b", "hf--org--tiny--abc", "complete"),
        ("node-b", "url--h-x.gguf--def", "downloading"),
    ]
    assert rows[0]["source"] == "hf://org/tiny@main" and rows[0]["size_bytes"] == 1234
    only = api.client.get("/api/v1/models/cache", params={"node": "node-a"}, headers=admin)
    assert [r["node"] for r in only.json()] == ["node-a"]


@pytest.mark.feature("H9")
def test_a_claimed_pull_names_the_nodes_holding_a_copy(api: Api) -> None:
    """As a launch's claim does: the node copies from the fleet before it asks the origin
    (and a ``fleet://`` pull has nowhere else to go)."""
    admin = api.login()
    node_id = beat(api)
    key = parse_model_source(f"hf://org/tiny@{COMMIT}").cache_key
    entry = {"key": key, "source": "hf://org/tiny@main", "revision": COMMIT,
             "size_bytes": 10, "state": "complete"}
    beat(api, "node-b", [entry], peer_url="http://127.0.0.1:7001")
    beat(api, "node-c", [{**entry, "state": "downloading"}], peer_url="http://127.0.0.1:7002")
    ids = [api.client.post(PULL.format("node-a"), json={"source": src}, headers=admin).json()["id"]
           for src in ("hf://org/tiny", f"fleet://{key}", "hf://org/other")]
    evict = api.client.post(EVICT.format("node-a"), json={"key": key}, headers=admin).json()
    claimed = {c["id"]: c for c in agent_get(api, node_id)}
    holder = [{"node": "node-b", "url": "http://127.0.0.1:7001", "key": key}]
    assert claimed[ids[0]]["peers"] == holder
    assert claimed[ids[1]]["peers"] == holder
    assert claimed[ids[2]]["peers"] == [] and claimed[evict["id"]]["peers"] == []


# ---- the agent's round, for real --------------------------------------------------------


class FakeAgent:
    """What ``ModelRequests`` uses of ``AgentState``: the client, the settings, the cache,
    the heartbeat's nudge, the HTTP session the resolver rides on, and the name and clock
    a copy from a holder is signed with."""

    def __init__(self, client: ServerClient, settings: AgentSettings, cache: ModelCache) -> None:
        self.name = "node-a"
        self.clock = cache.clock
        self.client = client
        self.settings = settings
        self.model_cache = cache
        self._nudge = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http


@pytest.fixture
async def hub_url() -> AsyncIterator[str]:
    hub = ModelHub(repos={
        "org/tiny": Repo({"config.json": CONFIG, "model.safetensors": WEIGHTS},
                         lfs=frozenset({"model.safetensors"})),
        "org/private": Repo({"model.safetensors": WEIGHTS}, token="someone-else-s"),
    })
    server = TestServer(hub.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def agent(api: Api, hub_url: str, tmp_path: Path) -> AsyncIterator[FakeAgent]:
    node_id = beat(api)
    client = ServerClient("http://server", NODE_TOKEN, 10)
    client._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api.app.asgi.api), base_url="http://server",
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    client.node_id = node_id
    settings = AgentSettings(hf_endpoint=hub_url, hub_token=SecretStr(TOKEN),
                             image_pull_report_interval_s=0.01, work_dir=tmp_path / "agent")
    cache = ModelCache(tmp_path / "agent" / "models", clock=api.clock)
    fake = FakeAgent(client, settings, cache)
    try:
        yield fake
    finally:
        await client.aclose()
        if fake._http is not None:
            await fake._http.close()


async def served(agent: FakeAgent) -> None:
    rounds = ModelRequests()
    await rounds.round(cast(AgentState, agent))
    await rounds.wait()
    await rounds.round(cast(AgentState, agent))  # anything owed is delivered


@pytest.mark.feature("H9")
async def test_the_agent_pulls_refuses_to_evict_a_model_in_use_then_evicts_it(
    api: Api, agent: FakeAgent
) -> None:
    admin = api.login()
    pull = api.client.post(PULL.format("node-a"), json={"source": "hf://org/tiny"},
                           headers=admin).json()
    await served(agent)
    got = api.client.get(f"/api/v1/model-requests/{pull['id']}", headers=admin).json()
    key = parse_model_source(f"hf://org/tiny@{COMMIT}").cache_key
    assert got["status"] == "done", got
    assert got["key"] == key and got["done_bytes"] == len(WEIGHTS) + len(CONFIG)
    assert f"is in this node's cache as {key}" in got["message"]
    assert agent._nudge.is_set()  # the heartbeat goes now: the list shows it sooner
    assert (agent.model_cache.path_of(key) / "model.safetensors").read_bytes() == WEIGHTS
    [ev] = node_events(api, agent.client.node_id)
    assert ev.kind == "node.model_pulled" and "hf://org/tiny@main" in ev.message

    agent.model_cache.acquire(key)  # a task here uses it
    evict = api.client.post(EVICT.format("node-a"), json={"key": key}, headers=admin).json()
    await served(agent)
    got = api.client.get(f"/api/v1/model-requests/{evict['id']}", headers=admin).json()
    assert got["status"] == "failed" and "in use" in got["message"], got
    assert agent.model_cache.is_complete(key)

    agent.model_cache.release(key)
    evict = api.client.post(EVICT.format("node-a"), json={"key": key}, headers=admin).json()
    await served(agent)
    got = api.client.get(f"/api/v1/model-requests/{evict['id']}", headers=admin).json()
    assert got["status"] == "done" and "evicted" in got["message"], got
    assert not agent.model_cache.is_complete(key)
    kinds = [e.kind for e in node_events(api, agent.client.node_id)]
    assert kinds == ["node.model_pulled", "node.model_request_failed", "node.model_evicted"]


async def test_a_pull_that_fails_says_why_and_never_shows_the_token(
    api: Api, agent: FakeAgent
) -> None:
    admin = api.login()
    ids = [
        api.client.post(PULL.format("node-a"), json={"source": s}, headers=admin).json()["id"]
        for s in ("hf://org/private", "hf://org/missing", "fleet://hf--org--tiny--x")
    ]
    await served(agent)
    got = [api.client.get(f"/api/v1/model-requests/{i}", headers=admin).json() for i in ids]
    assert [g["status"] for g in got] == ["failed"] * 3, got
    assert "(unauthorized)" in got[0]["message"] or "(not_found)" in got[0]["message"]
    assert "(not_found)" in got[1]["message"]
    assert "fleet://hf--org--tiny--x" in got[2]["message"] and "no node holding it" in got[2][
        "message"]
    for g in got:
        assert TOKEN not in g["message"]
    for e in node_events(api, agent.client.node_id):
        assert TOKEN not in e.message


async def test_an_outcome_the_server_did_not_take_is_sent_again(
    api: Api, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = api.login()
    mr = api.client.post(EVICT.format("node-a"), json={"key": "hf--org--none--1"},
                         headers=admin).json()
    real = agent.client.model_report
    calls: list[str] = []

    async def away_once(rid: str, rep: ModelRequestReport) -> str:
        calls.append(rep.status)
        if len(calls) == 1:
            raise httpx.ConnectError("server away")
        return await real(rid, rep)

    monkeypatch.setattr(agent.client, "model_report", away_once)
    rounds = ModelRequests()
    await rounds.round(cast(AgentState, agent))
    await rounds.wait()
    # still held by the agent: the server's next claim does not fail it as lost
    await rounds.round(cast(AgentState, agent))
    got = api.client.get(f"/api/v1/model-requests/{mr['id']}", headers=admin).json()
    assert got["status"] == "failed" and "holds no model" in got["message"], got
    assert calls == ["failed", "failed"]
