"""Copies between nodes (issue 29 item 4, H9): a node fetches a model another node holds
from that node's agent — its peer server, signed with the node token — instead of from
the origin; ``fleet://<key>`` names such a copy; an origin that cannot be asked (an
air-gapped fleet) is bypassed by a copy, an origin that says no is not.

Two real agents (``Agent``: their caches, the holder's peer server on the loopback) and
the hub stand-in (``testing.model_hub``: no test machine reaches huggingface.co); the
task's notes are recorded instead of sent (the report route is the server's, tested
with it elsewhere).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.fetching import fetch_model
from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.agent.model_cache.cache import MARKER
from heteroflow.agent.peer_server import serve_peers
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.clock import FakeClock
from heteroflow.core.model_sources import parse_model_source
from heteroflow.core.node_signature import sign
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.schemas.nodes import PeerCopy, TaskAssignment
from heteroflow.settings import AgentSettings
from heteroflow.testing.model_hub import COMMIT, ModelHub, Repo
from tests.conftest import free_port

pytestmark = pytest.mark.feature("H9")

TOKEN = "node-token-0123456789abcdef"
WEIGHTS = bytes(range(256)) * 64
CONFIG = b'{"model_type": "llama"}'
SOURCE = "hf://org/tiny"


class Launcher:
    runtime = type("R", (), {"name": "docker"})()

    def engines(self) -> dict[str, str]:
        return {}

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


class Node:
    """One agent, its recorded notes, and (the holder) its peer server."""

    def __init__(self, name: str, root: Path, hub: str, clock: FakeClock, **kw: Any) -> None:
        settings = AgentSettings(server_url="http://server.invalid", node_token=TOKEN,
                                 node_name=name, work_dir=root / name, hf_endpoint=hub,
                                 model_resolve_timeout_s=3.0, **kw)
        self.agent = Agent(settings, NodeConfig(model_scan_dirs=()), Launcher(),  # type: ignore[arg-type]
                           clock, nvml=NvmlDiscovery(platform="none"))
        self.notes: list[str] = []
        self.stop = asyncio.Event()
        self.url = ""

        async def report(task_id: str, status: str, message: str, **_: Any) -> None:
            self.notes.append(message)

        self.agent._report = report  # type: ignore[method-assign,assignment]

    async def serve(self) -> str:
        bound = asyncio.Event()

        def on(url: str) -> None:
            self.url = url
            bound.set()

        self.server = asyncio.create_task(serve_peers(self.agent, self.stop, on))
        await asyncio.wait_for(bound.wait(), 5)
        return self.url

    async def close(self) -> None:
        self.stop.set()
        if hasattr(self, "server"):
            await self.server
        await self.agent.client.aclose()
        if self.agent._http is not None:
            await self.agent._http.close()


def task(model_path: str, peers: list[PeerCopy] = ()) -> TaskAssignment:  # type: ignore[assignment]
    return TaskAssignment(
        id="t-1", group_id="g-1", name="svc-0", status="starting", task_type="inference",
        model_name="svc", model_path=model_path, image="vllm/vllm-openai", engine="vllm",
        command=[], engine_args=[], env=[], ports=[], gpu_ids=[], gpu_required=0,
        memory_mb=0, health_check={}, model_peers=list(peers),
    )


@pytest.fixture
def hub() -> ModelHub:
    return ModelHub(repos={"org/tiny": Repo(
        {"config.json": CONFIG, "model.safetensors": WEIGHTS},
        lfs=frozenset({"model.safetensors"}),
    )})


@pytest.fixture
async def hub_url(hub: ModelHub) -> AsyncIterator[str]:
    server = TestServer(hub.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def holder(tmp_path: Path, hub_url: str) -> AsyncIterator[Node]:
    """Node a: the model fetched from the hub into its cache, its peer server up."""
    node = Node("node-a", tmp_path, hub_url, FakeClock(), peer_port=0)
    manifest = await SourceResolver(hf_endpoint=hub_url).resolve(parse_model_source(SOURCE))
    await node.agent.model_cache.ensure(manifest)
    await node.serve()
    yield node
    await node.close()


@pytest.fixture
async def taker(tmp_path: Path, hub_url: str) -> AsyncIterator[Node]:
    node = Node("node-b", tmp_path, hub_url, FakeClock())
    yield node
    await node.close()


def key_of(node: Node) -> str:
    (m,) = node.agent.model_cache.list()
    return m.key


def peer(node: Node) -> PeerCopy:
    return PeerCopy(node="node-a", url=node.url, key=key_of(node))


def same_files(entry: Path) -> None:
    assert (entry / "model.safetensors").read_bytes() == WEIGHTS
    assert (entry / "config.json").read_bytes() == CONFIG


async def test_a_model_another_node_holds_is_copied_from_it_not_the_origin(
    hub: ModelHub, holder: Node, taker: Node
) -> None:
    before = len(hub.fetches("model.safetensors"))
    got = await fetch_model(taker.agent, task(SOURCE, [peer(holder)]))
    same_files(Path(got.model_path))
    assert len(hub.fetches("model.safetensors")) == before  # the weights came from node a
    assert key_of(taker) == key_of(holder)  # one key fleet-wide: placement finds both
    marker = json.loads((Path(got.model_path) / MARKER).read_text())
    assert marker["manifest"]["copied_from"] == "node-a"
    assert any("copied from node node-a" in n for n in taker.notes), taker.notes


async def test_fleet_names_a_copy_by_its_key(holder: Node, taker: Node) -> None:
    key = key_of(holder)
    got = await fetch_model(taker.agent, task(f"fleet://{key}", [peer(holder)]))
    same_files(Path(got.model_path))
    # the second time this node's own copy serves, and no holder is needed
    again = await fetch_model(taker.agent, task(f"fleet://{key}"))
    assert again.model_path == got.model_path


async def test_fleet_with_no_holder_answering_fails_with_why(holder: Node, taker: Node) -> None:
    key = key_of(holder)
    with pytest.raises(LaunchFailed, match="serves copies now"):
        await fetch_model(taker.agent, task(f"fleet://{key}"))
    gone = PeerCopy(node="node-x", url=f"http://127.0.0.1:{free_port()}", key=key)
    with pytest.raises(LaunchFailed, match=r"node node-x: .*could not be reached"):
        await fetch_model(taker.agent, task(f"fleet://{key}", [gone]))


async def test_an_origin_that_cannot_be_asked_is_bypassed_by_a_copy(
    tmp_path: Path, holder: Node
) -> None:
    """The air-gapped fleet: the hub is unreachable from node c; node a holds the model."""
    dead = f"http://127.0.0.1:{free_port()}"
    node = Node("node-c", tmp_path, dead, FakeClock())
    try:
        got = await fetch_model(node.agent, task(SOURCE, [peer(holder)]))
        same_files(Path(got.model_path))
        assert any("the origin could not be asked (unreachable)" in n for n in node.notes)
        # and without a holder it fails, naming the origin's reason
        alone = Node("node-d", tmp_path, dead, FakeClock())
        try:
            with pytest.raises(LaunchFailed, match="unreachable"):
                await fetch_model(alone.agent, task(SOURCE))
        finally:
            await alone.close()
    finally:
        await node.close()


async def test_an_origin_that_says_no_is_not_bypassed(
    hub: ModelHub, holder: Node, taker: Node
) -> None:
    with pytest.raises(LaunchFailed, match="not_found"):
        await fetch_model(taker.agent, task("hf://org/gone", [peer(holder)]))


async def test_a_holder_on_another_token_gives_way_to_the_origin(
    hub: ModelHub, tmp_path: Path, hub_url: str
) -> None:
    """Two nodes on different node tokens (a rotation half done) cannot copy from each
    other: the copy fails over to the origin, and the task still starts."""
    other = Node("node-a", tmp_path / "o", hub_url, FakeClock(), peer_port=0)
    other.agent.settings.node_token = "another-token-000000000000"
    manifest = await SourceResolver(hf_endpoint=hub_url).resolve(parse_model_source(SOURCE))
    await other.agent.model_cache.ensure(manifest)
    await other.serve()
    taker = Node("node-b", tmp_path, hub_url, FakeClock())
    try:
        before = len(hub.fetches("model.safetensors"))
        got = await fetch_model(taker.agent, task(SOURCE, [peer(other)]))
        same_files(Path(got.model_path))
        assert len(hub.fetches("model.safetensors")) == before + 1  # from the origin
    finally:
        await taker.close()
        await other.close()


async def test_the_peer_server_serves_only_signed_requests_for_listed_files(
    holder: Node,
) -> None:
    key = key_of(holder)
    entry = holder.agent.model_cache.path_of(key)
    (entry / "link").symlink_to("/etc/passwd")
    now = holder.agent.clock.now().timestamp()

    def signed(path: str, token: str = TOKEN, at: float = now) -> dict[str, str]:
        return {"Authorization": sign(token, "GET", path, "node-b", at)}

    async with aiohttp.ClientSession() as http:
        async def get(path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
            async with http.get(f"{holder.url}{path}", headers=headers or {}) as r:
                return r.status, await r.read()

        base = f"/v1/models/{key}"
        status, body = await get(base, signed(base))
        assert status == 200
        listed = json.loads(body)
        assert {f["path"] for f in listed["files"]} == {"config.json", "model.safetensors"}
        sha = {f["path"]: f["sha256"] for f in listed["files"]}
        assert sha["model.safetensors"] == hashlib.sha256(WEIGHTS).hexdigest()
        assert listed["revision"] == COMMIT
        weights = f"{base}/files/model.safetensors"
        assert await get(weights, signed(weights)) == (200, WEIGHTS)
        # a range resumes a cut copy
        async with http.get(f"{holder.url}{weights}",
                            headers={**signed(weights), "Range": "bytes=100-"}) as r:
            assert r.status == 206 and await r.read() == WEIGHTS[100:]
        assert (await get(weights))[0] == 401  # unsigned
        assert (await get(weights, signed(weights, token="wrong-token")))[0] == 401
        assert (await get(weights, signed(weights, at=now - 3600)))[0] == 401  # too old
        assert (await get(weights, signed(base)))[0] == 401  # signed for another path
        for bad in (f"{base}/files/link", f"{base}/files/{MARKER}",
                    f"{base}/files/..%2F..%2Fetc%2Fpasswd", "/v1/models/not-held"):
            assert (await get(bad, signed(bad)))[0] == 404, bad
