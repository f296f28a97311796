"""Sleep and wake end to end with the real llama.cpp engine on the process runtime
(F1, F2, A8): ``heteroflow server`` + ``heteroflow agent`` processes, the OpenAI SDK
through the server's gateway, and the CLI.

The agent runs with its DEFAULT heartbeat interval (5 s): a sleep stops the engine, and
a wake starts it, well within one heartbeat — the agent's light poll carries both. The
figures (sleep -> engine process gone, wake -> first answer) are printed (``-s``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.conftest import free_port

from .conftest import ADMIN_PASSWORD, NODE_TOKEN, Stack, engine_pid, pid_gone, spawn, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Server (with its gateway) and a process-runtime agent on its default heartbeat."""
    tmp = tmp_path_factory.mktemp("sleep")
    models = tmp / "models"
    models.mkdir()
    model_file = write_tiny_gguf(models / "tiny.gguf")
    port = free_port()
    pool = random.randint(22000, 31000)
    url = f"http://127.0.0.1:{port}"
    st = Stack(tmp, models, model_file, url, url)
    (tmp / "node.json").write_text(
        json.dumps({"allowed_volume_prefixes": [str(models)], "model_scan_dirs": [str(models)]})
    )
    server_env = {
        "HETEROFLOW_DATA_DIR": str(tmp / "server"),
        "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_PORT_POOL_START": str(pool),
        "HETEROFLOW_PORT_POOL_END": str(pool + 40),
        "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
        "HETEROFLOW_SNAPSHOT_INTERVAL_S": "0.2",
    }
    agent_env = {
        "HETEROFLOW_AGENT_SERVER_URL": url,
        "HETEROFLOW_AGENT_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_AGENT_NODE_NAME": "sleep-node",
        "HETEROFLOW_AGENT_CONFIG_FILE": str(tmp / "node.json"),
        "HETEROFLOW_AGENT_WORK_DIR": str(tmp / "agent"),
        "HETEROFLOW_AGENT_CPU_THREADS": "1",
        "HETEROFLOW_AGENT_RUNTIME": "process",
        # heartbeat_interval_s left at its default (5 s): the light poll does the work
    }
    try:
        st.procs.append(spawn("server", ["server", "--port", str(port)], server_env, tmp))
        wait_for(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, 30, "server")
        st.procs.append(spawn("agent", ["agent"], agent_env, tmp))
        r = httpx.post(
            url + "/api/v1/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}
        )
        st.token = r.json()["access_token"]
        wait_for(lambda: st.api("GET", "/api/v1/nodes").json(), 30, "node registered")
        yield st
    finally:
        for p in reversed(st.procs):
            p.stop()


def cli(st: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HETEROFLOW_CLI_DIR": str(st.tmp / "cli"),
        "HETEROFLOW_PASSWORD": ADMIN_PASSWORD,
    }
    r = subprocess.run(
        [sys.executable, "-m", "heteroflow.cli", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def answer(client: openai.OpenAI, model: str) -> bool:
    try:
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
        )
    except (openai.APIStatusError, openai.APIConnectionError, openai.APITimeoutError):
        return False
    return bool(out.choices[0].message.content)


def task(st: Stack, task_id: str) -> dict[str, Any]:
    return dict(st.api("GET", f"/api/v1/tasks/{task_id}").json())


def running_service(st: Stack, name: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    g = st.create_service(name)
    g_run = st.wait_status(g["id"], "running", 60)
    t = g_run["tasks"][0]
    port = int(t["ports"][0]["host_port"])
    pid = wait_for(lambda: engine_pid(port), 10, "the engine process")
    return g, t, int(pid)


@pytest.mark.feature("F1", "F2", "A8")
def test_sleep_stops_the_engine_and_wake_answers_again(stack: Stack) -> None:
    g, t, pid = running_service(stack, "napper")
    client = openai.OpenAI(
        base_url=stack.server_url + "/v1", api_key=g["api_key"], max_retries=0, timeout=10
    )
    wait_for(lambda: answer(client, "napper-model"), 20, "an answer before the sleep")

    start = time.monotonic()
    r = stack.api("POST", f"/api/v1/tasks/{t['id']}/sleep")
    assert r.status_code == 202, r.text
    wait_for(lambda: pid_gone(pid), 10, "the engine process gone", 0.02)
    gone_s = time.monotonic() - start
    assert gone_s < 5, f"{gone_s:.2f} s: the light poll should beat the 5 s heartbeat"
    assert stack.group(g["id"])["status"] == "sleeping"
    time.sleep(1)
    assert task(stack, t["id"])["status"] == "sleeping"  # not "lost", not relaunched
    assert engine_pid(int(t["ports"][0]["host_port"])) is None

    start = time.monotonic()
    w = stack.api("POST", f"/api/v1/tasks/{t['id']}/wake")
    assert w.status_code == 202 and w.json()["branch"] == "waking", w.text
    wait_for(lambda: answer(client, "napper-model"), 30, "an answer after the wake", 0.02)
    woke_s = time.monotonic() - start
    assert woke_s < 5, f"{woke_s:.2f} s from wake to the first answer"
    assert task(stack, t["id"])["status"] == "running"
    new_pid = engine_pid(int(t["ports"][0]["host_port"]))
    assert new_pid is not None and new_pid != pid
    print(f"\nprocess runtime, tiny model: sleep -> engine gone {gone_s:.2f} s; "
          f"wake -> first answer {woke_s:.2f} s")


@pytest.mark.feature("F1", "F2", "A8")
def test_the_cli_puts_tasks_and_services_to_sleep_and_wakes_them(stack: Stack) -> None:
    g, t, pid = running_service(stack, "clinap")
    client = openai.OpenAI(
        base_url=stack.server_url + "/v1", api_key=g["api_key"], max_retries=0, timeout=10
    )
    cli(stack, "login", "--server", stack.server_url)

    out = cli(stack, "tasks", "sleep", t["id"]).stdout
    assert f"{t['id']} is sleeping" in out
    wait_for(lambda: pid_gone(pid), 10, "the engine process gone")
    out = cli(stack, "tasks", "wake", t["id"], "--wait").stdout
    assert f"{t['id']} waking:" in out and out.rstrip().endswith(f"task {t['id']} is running")
    assert answer(client, "clinap-model")

    out = cli(stack, "services", "sleep", g["id"]).stdout
    assert f"{g['id']}: 1 task(s) put to sleep ({t['id']})" in out
    assert stack.group(g["id"])["status"] == "sleeping"
    out = cli(stack, "services", "wake", g["id"], "--wait").stdout
    assert f"{t['id']} waking:" in out and out.rstrip().endswith(f"service {g['id']} is running")
    wait_for(lambda: answer(client, "clinap-model"), 10, "an answer after the CLI wake")
    # a wake of a running service names its branch
    out = cli(stack, "services", "wake", g["id"]).stdout
    assert f"{t['id']} already_running:" in out
