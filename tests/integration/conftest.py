"""An in-process server (real database, real ASGI app) and helpers to drive it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import redis
from fastapi.testclient import TestClient
from redis.exceptions import RedisError

from heteroflow.core.clock import FakeClock
from heteroflow.server import ServerApp
from heteroflow.settings import ServerSettings

ADMIN_PASSWORD = "admin-pass-for-tests"
# Where test nodes allow model files (besides the test's tmp_path); service_body's model
# is a relative name, which needs no node (the agent looks it up under /data/models).
TEST_PREFIXES = ("/models", "/m", "/data/models")
NODE_TOKEN = "node-token-for-tests"
REDIS_URL = os.environ.get("HETEROFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass
class Api:
    app: ServerApp
    client: TestClient
    clock: FakeClock
    tmp: Path | None = None  # the test's tmp_path: test nodes allow model files there

    def login(self, username: str = "admin", password: str = ADMIN_PASSWORD) -> dict[str, str]:
        r = self.client.post(
            "/api/v1/auth/login", json={"username": username, "password": password}
        )
        assert r.status_code == 200, r.text
        return {"Authorization": f"Bearer {r.json()['access_token']}"}

    def member(self, admin: dict[str, str], tenant: str, username: str) -> dict[str, str]:
        t = self.client.post("/api/v1/tenants", json={"name": tenant}, headers=admin)
        assert t.status_code == 201, t.text
        u = self.client.post(
            "/api/v1/users",
            json={"username": username, "password": "member-pass-1", "tenant_id": t.json()["id"]},
            headers=admin,
        )
        assert u.status_code == 201, u.text
        return self.login(username, "member-pass-1")

    def heartbeat(
        self,
        name: str = "node-a",
        gpus: list[dict[str, Any]] | None = None,
        memory_mb: int = 16384,
        allowed: list[str] | None = None,
        runtime: str = "docker",
        ports_in_use: list[int] | None = None,
    ) -> str:
        r = self.client.post(
            "/api/v1/agent/heartbeat",
            json={
                "name": name,
                "address": "127.0.0.1",
                # a simulated Docker node: the process runtime takes only llama.cpp
                # without a custom command (tests of that rule say runtime "process")
                "runtime": runtime,
                # C4 volume rules: absolute model paths must be inside (create checks)
                "allowed_volume_prefixes": allowed
                if allowed is not None
                else [*TEST_PREFIXES, *([str(self.tmp)] if self.tmp else [])],
                "inventory": {
                    "gpus": gpus or [],
                    "cpu_count": 4,
                    "memory_total_mb": memory_mb,
                    "memory_available_mb": memory_mb,
                },
                "host_ports_in_use": ports_in_use or [],
            },
            headers={"Authorization": f"Bearer {NODE_TOKEN}"},
        )
        assert r.status_code == 200, r.text
        return str(r.json()["node_id"])

    def agent_post(self, node_id: str, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(
            path,
            json=body,
            headers={"Authorization": f"Bearer {NODE_TOKEN}", "X-Heteroflow-Node": node_id},
        )


def service_body(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "svc",
        "task": {
            "image": "ghcr.io/ggml-org/llama.cpp:server",
            "gpu_required": 0,
            "model_path": "tiny.gguf",
        },
    }
    task_over = over.pop("task", {})
    body.update(over)
    body["task"].update(task_over)
    return body


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    settings = ServerSettings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        admin_password=ADMIN_PASSWORD,
        node_token=NODE_TOKEN,
        gateway_token="gw-token-for-tests",
        port_pool_start=21000,
        port_pool_end=21009,
    )
    clock = FakeClock()
    app = ServerApp(settings, clock=clock)
    with TestClient(app.asgi) as client:
        yield Api(app=app, client=client, clock=clock, tmp=tmp_path)
    app.db.dispose()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh key prefix on a reachable Redis; its keys are deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5, socket_timeout=2.0)
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        client.close()
        reason = f"Redis at {REDIS_URL} is unreachable ({type(exc).__name__})"
        if os.environ.get("HETEROFLOW_REQUIRE_REDIS") == "1":
            pytest.fail(f"{reason} and HETEROFLOW_REQUIRE_REDIS=1")
        pytest.skip(f"{reason}; HETEROFLOW_REQUIRE_REDIS=1 makes this a failure")
    p = f"hf-test-{uuid4().hex}:"
    try:
        yield p
    finally:
        keys = list(client.scan_iter(match=p + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
