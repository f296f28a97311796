"""The agent's LoRA loader (agent/adapters.py) against a fake vLLM on a real socket:
it loads what the server lists once the engine is healthy, unloads what left the list,
retries a failed load with back-off (reported once per change, never a restart), checks
the folder on the node first, and takes vLLM's "already loaded" after an agent restart
as loaded. The real vLLM does the same in tests/e2e/test_vllm_real.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from heteroflow.agent.adapters import Adapters
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.state import Local, Outgoing
from heteroflow.core.clock import FakeClock
from heteroflow.core.health import HealthCheckConfig, HealthTracker
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.settings import AgentSettings

KEY = "hfe-test-engine-key"


@dataclass
class FakeVllm:
    """vLLM's two runtime LoRA routes, with its answers (checked against 0.32 by hand)."""

    loaded: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    fail_loads: int = 0  # the next N loads answer 500
    port: int = 0

    async def load(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        body = await request.json()
        self.calls.append(("load", body["lora_name"]))
        if self.fail_loads:
            self.fail_loads -= 1
            return web.json_response({"error": {"message": "engine busy"}}, status=500)
        if body["lora_name"] in self.loaded:
            msg = f"The lora adapter '{body['lora_name']}' has already been loaded."
            return web.json_response({"error": {"message": msg}}, status=400)
        self.loaded[body["lora_name"]] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added")

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("unload", body["lora_name"]))
        if self.loaded.pop(body["lora_name"], None) is None:
            return web.json_response({"error": {"message": "cannot be found"}}, status=404)
        return web.Response(text="removed")


@pytest.fixture
async def engine() -> AsyncIterator[FakeVllm]:
    fake = FakeVllm()
    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", fake.load)
    app.router.add_post("/v1/unload_lora_adapter", fake.unload)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = runner.addresses[0][1]
    yield fake
    await runner.cleanup()


class Launcher:
    runtime: Any = None

    def probe_host_for(self, t: TaskAssignment, port: int) -> str:
        return "127.0.0.1"


class Runtime:
    name = "process"


class Node(Adapters):
    """The loader alone: the agent's state it reads, a fake outbox."""

    def __init__(self, allowed: Path) -> None:  # no super().__init__: no server, no NVML
        self.settings = AgentSettings(lora_retry_base_s=5, lora_retry_max_s=20)
        self.config = NodeConfig(allowed_volume_prefixes=(str(allowed),))
        self.fake_clock = FakeClock()
        self.clock = self.fake_clock
        self.launcher = Launcher()  # type: ignore[assignment]
        self.runtime = Runtime()  # type: ignore[assignment]
        self.local: dict[str, Local] = {}
        self.stopping: set[str] = set()
        self.outbox: dict[str, Outgoing] = {}
        self.said: list[str] = []
        self._http = None

    async def _flush_outbox(self) -> None:
        for task_id, out in list(self.outbox.items()):
            assert out.status == "running" and out.note == "adapter"
            self.said.append(out.message)
            del self.outbox[task_id]

    async def round(self) -> None:
        self._sync_adapters()
        assert self._lora_round is not None
        await self._lora_round


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in made:
        if n._http is not None:
            await n._http.close()


def task(port: int, adapters: list[dict[str, str]], max_loras: int = 2) -> TaskAssignment:
    return TaskAssignment(
        id="task-0123456789ab", group_id="tg-0123456789ab", name="svc-0", status="running",
        task_type="inference", model_name="base", model_path="/m/base", image="",
        engine="vllm", command=[], engine_args=[], env=[],
        ports=[{"container_port": 8000, "host_port": port, "from_pool": True}],
        gpu_ids=[], gpu_required=0, memory_mb=0, health_check={}, engine_key=KEY,
        max_loras=max_loras, lora_adapters=adapters,
    )


def local(t: TaskAssignment, healthy: bool = True) -> Local:
    health = HealthCheckConfig.from_api({})
    port = int(t.ports[0]["host_port"])
    return Local(task=t, tracker=HealthTracker(health, 0.0), health=health, port=port,
                 reported_running=healthy)


def adapter_dir(root: Path, name: str) -> str:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(d)


async def test_loads_once_healthy_unloads_what_left_and_reports_changes(
    engine: FakeVllm, tmp_path: Path, nodes: list[Node]
) -> None:
    node = Node(tmp_path)
    nodes.append(node)
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    t = task(engine.port, [{"name": "ad-a", "path": a}])
    node.local[t.id] = local(t, healthy=False)
    await node.round()
    assert engine.calls == []  # not before its first passing health check
    node.local[t.id].reported_running = True
    await node.round()
    assert engine.loaded == {"ad-a": a}
    assert node.said == ["serving LoRA adapter(s): ad-a"]
    await node.round()  # nothing changed: no call, nothing said
    assert len(engine.calls) == 1 and len(node.said) == 1
    # the list changes: ad-a out, ad-b in — no restart, two calls
    node.local[t.id].task = task(engine.port, [{"name": "ad-b", "path": b}])
    await node.round()
    assert engine.loaded == {"ad-b": b}
    assert engine.calls[1:] == [("unload", "ad-a"), ("load", "ad-b")]
    assert node.said[-1] == "serving LoRA adapter(s): ad-b"


async def test_a_failed_load_is_retried_with_back_off_and_said_once(
    engine: FakeVllm, tmp_path: Path, nodes: list[Node]
) -> None:
    node = Node(tmp_path)
    nodes.append(node)
    a = adapter_dir(tmp_path, "a")
    t = task(engine.port, [{"name": "ad-a", "path": a}])
    node.local[t.id] = local(t)
    engine.fail_loads = 2
    await node.round()
    assert engine.loaded == {} and len(node.said) == 1
    assert "'ad-a' not loaded: HTTP 500: engine busy (try 1; next in 5 s)" in node.said[0]
    await node.round()  # inside its back-off: not tried
    assert len(engine.calls) == 1
    node.fake_clock.advance(5)
    await node.round()  # the second failure: 10 s now
    assert len(engine.calls) == 2 and "(try 2; next in 10 s)" in node.said[-1]
    node.fake_clock.advance(9)
    await node.round()
    assert len(engine.calls) == 2
    node.fake_clock.advance(1)
    await node.round()
    assert engine.loaded == {"ad-a": a}
    assert node.said[-1] == "serving LoRA adapter(s): ad-a" and len(node.said) == 3


async def test_the_node_checks_the_folder_before_the_engine_sees_it(
    engine: FakeVllm, tmp_path: Path, nodes: list[Node]
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    node = Node(allowed)
    nodes.append(node)
    outside = adapter_dir(tmp_path, "outside")
    (allowed / "link").symlink_to(outside)  # a symlink out of the allowed prefix
    empty = allowed / "empty"
    empty.mkdir()
    for path, why in (
        (outside, "outside the allowed volume prefixes"),
        (str(allowed / "link"), "leads outside the node's allowed volume prefixes"),
        (str(empty), "is not an adapter folder"),
    ):
        t = task(engine.port, [{"name": "ad-x", "path": path}])
        node.local = {t.id: local(t)}
        node._lora_engines = None
        await node.round()
        assert why in node.said[-1], node.said[-1]
    assert engine.calls == []


async def test_after_an_agent_restart_already_loaded_counts_as_loaded(
    engine: FakeVllm, tmp_path: Path, nodes: list[Node]
) -> None:
    a = adapter_dir(tmp_path, "a")
    engine.loaded = {"ad-a": a}  # loaded by the agent before its restart
    node = Node(tmp_path)
    nodes.append(node)
    t = task(engine.port, [{"name": "ad-a", "path": a}])
    node.local[t.id] = local(t)
    await node.round()
    assert node.said == ["serving LoRA adapter(s): ad-a"]
    # an engine without LoRA slots, or one that is not vLLM, is left alone
    for other in (task(engine.port, [{"name": "x", "path": a}], max_loras=0),
                  task(engine.port, [{"name": "x", "path": a}]).model_copy(
                      update={"engine": "llamacpp"})):
        node.local = {other.id: local(other)}
        node._lora_engines = None
        await node.round()
    assert len(engine.calls) == 1


async def test_an_engine_that_does_not_answer_is_a_reported_failure(
    tmp_path: Path, nodes: list[Node]
) -> None:
    node = Node(tmp_path)
    nodes.append(node)
    a = adapter_dir(tmp_path, "a")
    t = task(1, [{"name": "ad-a", "path": a}])  # nothing listens on port 1
    node.local[t.id] = local(t)
    await asyncio.wait_for(node.round(), timeout=30)
    assert "the engine did not answer" in node.said[-1]
