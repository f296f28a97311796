"""Scheduling knows where models are (issue 29 item 3, H9): two nodes heartbeat through
the API, one reports the model source complete in its cache; the dry run lists it in
``model_source.cached_on`` and the placement — the dry run's and the round's — goes
there, where without the report the other node would have been chosen.

The hub is ``testing.model_hub``'s stand-in on the loopback (no test machine reaches
huggingface.co).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import GpuCard, NodeInventory, NvmlDiscovery
from heteroflow.core.model_sources import parse_model_source
from heteroflow.db.tables import Node, Task
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.settings import AgentSettings
from heteroflow.testing.model_hub import COMMIT, ModelHub, Repo, serving

from .conftest import NODE_TOKEN, Api

pytestmark = pytest.mark.feature("H9")

WEIGHTS = bytes(range(256)) * 16
CONFIG = b'{"model_type": "llama"}'
SOURCE = "hf://org/tiny@main"


@pytest.fixture
def hub_url() -> Iterator[str]:
    hub = ModelHub(repos={"org/tiny": Repo({"config.json": CONFIG, "model.safetensors": WEIGHTS},
                                           lfs=frozenset({"model.safetensors"}))})
    with serving(hub) as url:
        yield url


def beat(api: Api, name: str, cache: list[dict[str, Any]] | None = None, *,
         card: str = "A10", peer_url: str = "") -> Any:
    return api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": name, "address": "127.0.0.1", "runtime": "docker",
            "inventory": {"gpus": [{"index": 0, "model": card, "memory_total_mb": 24576}],
                          "cpu_count": 4, "memory_total_mb": 16384,
                          "memory_available_mb": 16384},
            "model_cache": cache or [],
            "peer_url": peer_url,
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )


def entry(revision: str = COMMIT, state: str = "complete") -> dict[str, Any]:
    return {"key": "hf--org--tiny--0123456789abcdef", "source": SOURCE, "revision": revision,
            "size_bytes": len(WEIGHTS) + len(CONFIG), "state": state}


BODY: dict[str, Any] = {
    "name": "sourced", "model_name": "sourced",
    "task": {"image": "vllm/vllm-openai:v0.11.2", "engine": "vllm", "gpu_required": 1,
             "model_path": "hf://org/tiny"},
}


def dry_run(api: Api, headers: dict[str, str]) -> dict[str, Any]:
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=BODY, headers=headers)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_node_whose_cache_holds_the_source_is_chosen(api: Api, hub_url: str) -> None:
    api.app.settings.hf_endpoint = hub_url
    admin = api.login()
    for name in ("node-a", "node-b"):
        assert beat(api, name).status_code == 200
    before = dry_run(api, admin)
    assert before["tasks"][0]["placement"]["node_name"] == "node-a"  # the first, all equal
    assert before["model_source"]["cached_on"] == []
    # the size over the nominal rate (100 MB/s by default)
    assert before["model_source"]["download_s"] == round((len(WEIGHTS) + len(CONFIG)) / 1e8, 1)

    # node-b's agent reports the revision the hub resolves complete in its cache; node-a
    # one of another revision (a branch that moved since), which is not this one
    r = beat(api, "node-b", [entry()])
    assert r.status_code == 200, r.text
    assert beat(api, "node-a", [entry(revision="b" * 40, state="downloading")]).status_code == 200
    plan = dry_run(api, admin)
    assert plan["model_source"]["cached_on"] == ["node-b"]
    assert plan["tasks"][0]["placement"]["node_name"] == "node-b"

    r = api.client.post("/api/v1/task-groups", json=BODY, headers=admin)
    assert r.status_code == 201, r.text
    api.app.scheduler.run_round()
    with api.app.db.session() as s:
        task = s.query(Task).one()
        node = s.get(Node, task.node_id)
        assert task.status == "scheduled" and node is not None and node.name == "node-b"
    # the node list shows the cache entry beside the scan's models, with its source
    nodes = {n["name"]: n for n in api.client.get("/api/v1/nodes", headers=admin).json()}
    shown = nodes["node-b"]["models"]
    assert [(m["source"], m["revision"], m["state"]) for m in shown] == [
        (SOURCE, COMMIT, "complete")
    ]


KEY = "hf--org--tiny--0123456789abcdef"


def test_a_fleet_copy_is_resolved_from_the_reports_and_claimed_with_its_holders(
    api: Api, hub_url: str
) -> None:
    """fleet://<key>: the dry run takes size and revision from the holder's report; a
    create no node can serve is a 400; the claim of a task placed elsewhere names the
    holders that serve copies (and not the one that serves none, nor the claimer)."""
    api.app.settings.hf_endpoint = hub_url
    admin = api.login()
    assert beat(api, "node-a", [entry()], peer_url="http://10.0.0.1:3469").status_code == 200
    assert beat(api, "node-c", [entry()]).status_code == 200  # holds it, serves no copies
    assert beat(api, "node-b", card="L4", peer_url="http://10.0.0.2:3469").status_code == 200
    fleet = {**BODY, "task": {**BODY["task"], "model_path": f"fleet://{KEY}"}}
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=fleet, headers=admin)
    assert r.status_code == 200, r.text
    shown = r.json()["model_source"]
    assert (shown["kind"], shown["resolved"], shown["revision"], shown["bytes"]) == (
        "fleet", True, COMMIT, len(WEIGHTS) + len(CONFIG))
    assert shown["cached_on"] == ["node-a", "node-c"]
    nobody = {**BODY, "task": {**BODY["task"], "model_path": "fleet://hf--org--other--00"}}
    r = api.client.post("/api/v1/task-groups", json=nobody, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.model_path", r.text
    assert "no node you may use holds fleet://hf--org--other--00" in r.text

    on_b = {**fleet, "task": {**fleet["task"], "gpu_type": "L4"}}
    r = api.client.post("/api/v1/task-groups", json=on_b, headers=admin)
    assert r.status_code == 201, r.text
    api.app.scheduler.run_round()
    with api.app.db.session() as s:
        task = s.query(Task).one()
        node = s.get(Node, task.node_id)
        assert node is not None and node.name == "node-b" and node.peer_url.endswith(":3469")
    claimed = api.client.post(f"/api/v1/agent/tasks/{task.id}/claim",
                              headers={"Authorization": f"Bearer {NODE_TOKEN}",
                                       "X-HeteroFlow-Node": node.id})
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["model_peers"] == [
        {"node": "node-a", "url": "http://10.0.0.1:3469", "key": KEY}
    ]


def test_a_peer_url_is_an_address_and_nothing_more(api: Api) -> None:
    for bad in ("http://u:p@10.0.0.1:3469", "http://10.0.0.1:3469/x?q=1", "ftp://h:1",
                "http://10.0.0.1"):
        r = beat(api, "node-a", peer_url=bad)
        assert r.status_code == 400 and r.json()["error"]["field"] == "peer_url", (bad, r.text)


def test_a_cache_report_is_bounded_and_carries_no_credential(api: Api) -> None:
    bad = entry() | {"source": "https://user:secret@host/m.gguf"}
    r = beat(api, "node-a", [bad])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "model_cache.0.source" and "secret" not in r.text
    for cache, field in (([entry()] * 257, "model_cache"),
                         ([entry() | {"key": "../escape"}], "model_cache.0.key")):
        r = beat(api, "node-a", cache)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_the_agents_own_heartbeat_reports_what_it_fetched(
    api: Api, hub_url: str, tmp_path: Path
) -> None:
    """The daemon's heartbeat body after a real fetch into its cache (the hub stand-in,
    ``ModelCache.ensure``) is what the server stores and the dry run reads."""

    class Launcher:
        runtime = type("R", (), {"name": "docker"})()

        def engines(self) -> dict[str, str]:
            return {}

        def log_source(self, task_id: str, since: str) -> tuple[str, str]:
            return "", since

    api.app.settings.hf_endpoint = hub_url
    settings = AgentSettings(server_url="http://server", node_token=NODE_TOKEN,
                             node_name="node-b", work_dir=tmp_path / "agent")
    agent = Agent(settings, NodeConfig(model_scan_dirs=()), Launcher(),  # type: ignore[arg-type]
                  api.clock, nvml=NvmlDiscovery(platform="none"))
    card = GpuCard(index=0, uuid="GPU-b", vendor="nvidia", model="A10", memory_total_mb=24576,
                   memory_used_mb=0, compute_capability="8.6", mig_capable=False,
                   mps_capable=False, temperature_c=None, source="declared")
    inv = NodeInventory(gpus=(card,), cpu_count=4, memory_total_mb=16384,
                        memory_available_mb=16384, cpu_percent=1.0, memory_percent=2.0)
    assert agent._heartbeat_body(inv).model_cache == []  # nothing fetched: no folder made
    assert not (tmp_path / "agent" / "models").exists()

    async def fetch() -> None:
        resolver = SourceResolver(hf_endpoint=hub_url)
        manifest = await resolver.resolve(parse_model_source("hf://org/tiny"))
        await agent.model_cache.ensure(manifest)
        await agent.client.aclose()

    asyncio.run(fetch())
    body = agent._heartbeat_body(inv).model_dump(mode="json")
    assert [(m["source"], m["revision"], m["state"]) for m in body["model_cache"]] == [
        (SOURCE, COMMIT, "complete")
    ]
    assert beat(api, "node-a").status_code == 200
    r = api.client.post("/api/v1/agent/heartbeat", json=body,
                        headers={"Authorization": f"Bearer {NODE_TOKEN}"})
    assert r.status_code == 200, r.text
    plan = dry_run(api, api.login())
    assert plan["model_source"]["cached_on"] == ["node-b"]
    assert plan["tasks"][0]["placement"]["node_name"] == "node-b"
