"""Real processes: ``heteroflow server``, ``heteroflow agent``, ``heteroflow gateway``.

The stack is started once per module on ephemeral ports with short intervals; each
process logs to a file that is printed when a test fails.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.conftest import free_port

ADMIN_PASSWORD = "e2e-admin-password"
NODE_TOKEN = "e2e-node-token"
GATEWAY_TOKEN = "e2e-gateway-token"


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"----- {self.name} ({self.log}) -----\n" + "\n".join(lines[-n:])

    def stop(self, timeout_s: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return int(self.popen.returncode)


def spawn(
    name: str, args: list[str], env: dict[str, str], workdir: Path, prefix: tuple[str, ...] = ()
) -> Proc:
    """``heteroflow ARGS`` logging to ``workdir/NAME.log``; ``prefix`` runs it through
    another command first (``ip netns exec NS``: on another simulated host)."""
    log = workdir / f"{name}.log"
    out = open(log, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", "heteroflow.cli", *args],
        env={**os.environ, **env},
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=workdir,
    )
    return Proc(name, popen, log)


@dataclass
class Stack:
    tmp: Path
    models_dir: Path
    model_file: Path
    server_url: str
    gateway_url: str
    procs: list[Proc] = field(default_factory=list)
    token: str = ""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.server_url + path, headers=self.headers, timeout=30, **kw)

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def create_service(self, name: str, **extra: Any) -> dict[str, Any]:
        body = {
            "name": name,
            "model_name": f"{name}-model",
            "health_check": {"interval_seconds": 0.5, "start_period_seconds": 30},
            "task": {
                "image": "ghcr.io/ggml-org/llama.cpp:server",
                "gpu_required": 0,
                "model_path": str(self.model_file),
                "memory_mb": 512,
                "engine_args": ["--embeddings", "-np", "2", "-c", "1024"],
            },
            **extra,
        }
        r = self.api("POST", "/api/v1/task-groups", json=body)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def group(self, group_id: str) -> dict[str, Any]:
        return dict(self.api("GET", f"/api/v1/task-groups/{group_id}").json())

    def wait_status(self, group_id: str, status: str, timeout_s: float = 60) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            g = self.group(group_id)
            if g["status"] == "failed" and status != "failed":
                raise AssertionError(f"group failed: {g}\n{self.logs()}")
            return g if g["status"] == status else None

        return dict(wait_for(done, timeout_s, f"{group_id} to be {status}", 0.2))


def engine_pid(host_port: int) -> int | None:
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "heteroflow.engines.llamacpp_server" in cmd and str(host_port) in cmd:
            return int(p.info["pid"])
    return None


def pid_gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@contextmanager
def launch_stack(
    tmp: Path,
    *,
    node_name: str = "e2e-node",
    server_env: dict[str, str] | None = None,
    agent_env: dict[str, str] | None = None,
    gateway_env: dict[str, str] | None = None,
    agent_prefix: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """A real server, process-runtime agent and separate gateway serving the tiny model,
    logged in as admin, its node registered; stopped (reverse order) on exit. The extra
    environments add to (or override) the fast defaults every e2e stack shares;
    ``agent_prefix`` runs the agent (and so its engines) through another command first
    (a throttled cgroup: tests/e2e/test_slow_load.py)."""
    models = tmp / "models"
    models.mkdir(exist_ok=True)  # or a disk mounted there (tests/e2e/test_slow_load.py)
    model_file = write_tiny_gguf(models / "tiny.gguf")
    server_port, gateway_port = free_port(), free_port()
    pool = random.randint(22000, 31000)
    server_url = f"http://127.0.0.1:{server_port}"
    st = Stack(tmp, models, model_file, server_url, f"http://127.0.0.1:{gateway_port}")
    (tmp / "node.json").write_text(
        json.dumps({"allowed_volume_prefixes": [str(models)], "model_scan_dirs": [str(models)]})
    )
    server = {
        "HETEROFLOW_DATA_DIR": str(tmp / "server"),
        "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_GATEWAY_TOKEN": GATEWAY_TOKEN,
        "HETEROFLOW_PORT_POOL_START": str(pool),
        "HETEROFLOW_PORT_POOL_END": str(pool + 40),
        "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
        "HETEROFLOW_SNAPSHOT_INTERVAL_S": "0.2",
        **(server_env or {}),
    }
    agent = {
        "HETEROFLOW_AGENT_SERVER_URL": server_url,
        "HETEROFLOW_AGENT_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_AGENT_NODE_NAME": node_name,
        "HETEROFLOW_AGENT_CONFIG_FILE": str(tmp / "node.json"),
        "HETEROFLOW_AGENT_WORK_DIR": str(tmp / "agent"),
        "HETEROFLOW_AGENT_HEARTBEAT_INTERVAL_S": "0.3",
        "HETEROFLOW_AGENT_CPU_THREADS": "1",
        "HETEROFLOW_AGENT_RUNTIME": "process",
        **(agent_env or {}),
    }
    try:
        st.procs.append(spawn("server", ["server", "--port", str(server_port)], server, tmp))
        wait_for(
            lambda: httpx.get(server_url + "/healthz", timeout=1).status_code == 200,
            60,  # generous: a loaded 2-core box may take long to start a Python process
            "server /healthz",
        )
        st.procs.append(spawn("agent", ["agent"], agent, tmp, agent_prefix))
        wait_for(lambda: "process runtime" in st.procs[-1].log.read_text(), 60, "agent start")
        args = ["gateway", "--server", server_url, "--token", GATEWAY_TOKEN]
        st.procs.append(
            spawn("gateway", [*args, "--port", str(gateway_port)], gateway_env or {}, tmp)
        )
        wait_for(
            lambda: httpx.get(st.gateway_url + "/v1/models", timeout=1).status_code == 401,
            60,
            "gateway up",
        )
        r = httpx.post(
            server_url + "/api/v1/auth/login",
            json={"username": "admin", "password": ADMIN_PASSWORD},
        )
        st.token = r.json()["access_token"]
        # the node's first heartbeat carries its volume rules: create checks model paths
        wait_for(lambda: st.api("GET", "/api/v1/nodes").json(), 60, "node registered")
        yield st
    finally:
        for p in reversed(st.procs):
            p.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(
        tmp_path_factory.mktemp("e2e"),
        server_env={"HETEROFLOW_DATABASE_URL": os.environ.get("HETEROFLOW_E2E_DATABASE_URL", "")},
        agent_env={
            "HETEROFLOW_AGENT_LOG_SHIP_INTERVAL_S": "0.5",
            "HETEROFLOW_AGENT_PORT_RETRY_TOTAL_S": "6",
        },
    ) as st:
        yield st


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    rep = outcome.get_result()
    st = item.funcargs.get("stack") if hasattr(item, "funcargs") else None
    if rep.failed and isinstance(st, Stack):
        rep.sections.append(("process logs", st.logs()))
