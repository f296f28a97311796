"""Normal operations log nothing at WARNING: a create, a call, a delete and a shutdown.

A user reads WARNING as "something needs your attention"; a service deleted as asked and
a server stopped with Ctrl-C are not that. The whole ``heteroflow up`` stack runs here in
process (server, scheduler, gateway and a process-runtime agent running the real
llama.cpp engine on the tiny model), so every logger of every part is captured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import httpx
import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.factory import make_launcher
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.gateway.routing.probes import BackendMonitor
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.routing import Backend, RouteTarget, RoutingSnapshot
from heteroflow.server import ServerApp
from heteroflow.serving import bind
from heteroflow.settings import AgentSettings, ServerSettings
from tests.conftest import free_port

ADMIN_PASSWORD = "quiet-admin-password"
NODE_TOKEN = "quiet-node-token"
NODE_NAME = "quiet-node"
MSG = {"role": "user", "content": "hi"}


async def _until(what: str, check: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert callable(check)
        if await check():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("delete_first", [True, False], ids=["delete-then-stop", "stop-running"])
async def test_create_call_delete_and_shutdown_log_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, delete_first: bool
) -> None:
    """``delete-then-stop``: create, call, delete, shut down. ``stop-running``: create,
    call, shut down with the service running (Ctrl-C on ``heteroflow up``)."""
    caplog.set_level(logging.INFO)  # INFO is captured too: what the cycle says is visible
    models = tmp_path / "models"
    model = write_tiny_gguf(models / "tiny.gguf")
    app = ServerApp(
        ServerSettings(
            data_dir=tmp_path / "data",
            database_url=f"sqlite:///{tmp_path / 'hf.db'}",
            admin_password=ADMIN_PASSWORD,
            node_token=NODE_TOKEN,
            gateway_token="quiet-gateway-token",
            scheduler_interval_s=0.2,
            snapshot_interval_s=0.1,
            port_pool_start=21010,  # away from the default pool a running `up` uses
            port_pool_end=21019,
        )
    )
    sock = bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    node_cfg = NodeConfig(allowed_volume_prefixes=(str(models),))
    agent_settings = AgentSettings(
        server_url=base,
        node_token=NODE_TOKEN,
        node_name=NODE_NAME,
        work_dir=tmp_path / "agent",
        heartbeat_interval_s=0.3,
        cpu_threads=1,
        runtime="process",
        stop_engines_on_exit=True,
    )
    launcher = make_launcher(agent_settings, node_cfg, NODE_NAME)
    agent = Agent(agent_settings, node_cfg, launcher, app.clock)
    stop = asyncio.Event()
    server = asyncio.create_task(app.serve(stop, sock, extra=[agent.run]))
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            r = await c.post(
                "/api/v1/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}
            )
            admin = {"Authorization": f"Bearer {r.json()['access_token']}"}

            async def registered() -> bool:
                nodes = (await c.get("/api/v1/nodes", headers=admin)).json()
                return any(n["name"] == NODE_NAME for n in nodes)

            await _until("the agent's first heartbeat", registered)
            r = await c.post(
                "/api/v1/task-groups",
                json={
                    "name": "quiet",
                    "enable_api": True,
                    "health_check": {"start_period_seconds": 30, "interval_seconds": 0.5},
                    "task": {
                        "image": "ghcr.io/ggml-org/llama.cpp:server",
                        "engine": "llamacpp",
                        "gpu_required": 0,
                        "model_path": str(model),
                        "memory_mb": 1024,
                        "engine_args": ["-c", "512", "--embeddings"],
                    },
                },
                headers=admin,
            )
            assert r.status_code == 201, r.text
            group_id, key = r.json()["id"], r.json()["api_key"]
            task_id = r.json()["tasks"][0]["id"]

            async def task_is(*wanted: str) -> bool:
                t = await c.get(f"/api/v1/tasks/{task_id}", headers=admin)
                return t.status_code == 404 or t.json()["status"] in wanted

            await _until("the service to run", lambda: task_is("running"))

            async def answered() -> bool:
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": "quiet", "max_tokens": 4, "messages": [MSG]},
                    headers={"Authorization": f"Bearer {key}"},
                )
                return r.status_code == 200

            await _until("a routed answer", answered)
            if delete_first:
                r = await c.delete(f"/api/v1/task-groups/{group_id}", headers=admin)
                assert r.status_code == 204, r.text
                await _until("the engine to stop", lambda: task_is("stopped"))
                await asyncio.sleep(1.0)  # probe, snapshot and heartbeat rounds after it
    finally:
        stop.set()
        await asyncio.wait_for(server, 60)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    said = "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records)
    assert not loud, said


async def test_one_failed_probe_is_info_and_a_second_in_a_row_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine stopped as asked fails one probe before the next snapshot drops it."""
    caplog.set_level(logging.INFO, logger="heteroflow.gateway.routing.probes")
    dead = f"http://127.0.0.1:{free_port()}"
    target = RouteTarget("r", "g", 0, 1, (Backend("task-x", dead),), "round_robin", ())
    monitor = BackendMonitor(PassiveHealth(5.0), {}, lambda url: 0)
    monitor.track(RoutingSnapshot(version=1, routes={("t", "m"): (target,)}))
    try:
        await monitor.probe_once()  # stopped as asked: the route leaves with the next snapshot
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        monitor.track(RoutingSnapshot(version=2))
        monitor.track(RoutingSnapshot(version=3, routes={("t", "m"): (target,)}))
        await monitor.probe_once()  # listed again: a first failure again (still out: quiet)
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        await monitor.probe_once()  # still listed, still failing: a real problem
        await monitor.probe_once()  # said once
        assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    finally:
        await monitor.aclose()
