"""Engines reachable only through the platform (issue 26, item 1; FEATURES C14), tried
from another host: a network namespace on a bridge, as another machine on the node
network would be.

The stack (server, process-runtime agent, gateway) runs in this namespace, the agent
advertising the bridge's address — where the gateways of a cluster reach its engines.
From the other host: the engine's port without a key, with a tenant's gateway key, or
with a forged key is refused; with the engine's own key only the OpenAI surface,
health and metrics answer — ``/sleep``, ``/collective_rpc``, ``/slots`` and LoRA
loading never do; the engine's own listening address cannot be reached at all. The
platform's path (gateway, endpoint key) answers, and the engine's key is in no command
line and no log.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from heteroflow.core.engine_access import ENGINE_ADDRESS, ENGINE_KEY_SECRET, engine_key
from tests.netns import network

from .conftest import Stack, launch_stack

pytestmark = pytest.mark.e2e

# run inside the other host's namespace: each (method, url, headers) -> status or error
_CLIENT = """
import json, sys, httpx
out = []
for method, url, headers in json.loads(sys.argv[1]):
    try:
        out.append(httpx.request(method, url, headers=headers, timeout=5).status_code)
    except httpx.HTTPError as exc:
        out.append(type(exc).__name__)
print(json.dumps(out))
"""


def _from_other_host(ns: str, calls: list[tuple[str, str, dict[str, str]]]) -> list[object]:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", _CLIENT, json.dumps(calls)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return list(json.loads(done.stdout))


def _engine_secret(st: Stack) -> str:
    with sqlite3.connect(st.tmp / "server" / "heteroflow.db") as db:
        (secret,) = db.execute(
            "SELECT value FROM platform_settings WHERE key = ?", (ENGINE_KEY_SECRET,)
        ).fetchone()
    return str(secret)


@pytest.mark.feature("C14")
def test_an_engine_answers_only_the_platform_from_another_host(tmp_path: Path) -> None:
    with network(1) as net, launch_stack(
        tmp_path, agent_env={"HETEROFLOW_AGENT_ADDRESS": net.host_ip}
    ) as st:
        (ns, _), = net.nodes
        mine = st.create_service("walled")
        other = st.create_service("neighbour")  # another service's gateway key
        group = st.wait_status(mine["id"], "running")
        st.wait_status(other["id"], "running")
        [task] = group["tasks"]
        port = next(p["host_port"] for p in task["ports"])
        door = f"http://{net.host_ip}:{port}"
        key = engine_key(_engine_secret(st), task["id"])
        forged = "hfe-" + "0" * 64
        chat = {"model": "walled-model", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}
        bearer = {"Authorization": f"Bearer {key}"}

        refused = _from_other_host(ns, [
            ("GET", door + "/v1/models", {}),
            ("POST", door + "/v1/chat/completions", {}),
            ("POST", door + "/v1/chat/completions",
             {"Authorization": f"Bearer {other['api_key']}"}),
            ("POST", door + "/v1/chat/completions", {"Authorization": f"Bearer {forged}"}),
            ("POST", door + "/v1/chat/completions", {"Authorization": key}),  # not bearer
            ("GET", door + "/metrics", {}),
            ("GET", door + "/slots", {}),
            ("GET", door + "/props", {}),
            ("GET", door + "/health", {}),
        ])
        assert refused == [401] * 9

        unreachable = _from_other_host(ns, [
            ("POST", door + "/sleep?level=2", bearer),
            ("POST", door + "/wake_up", bearer),
            ("POST", door + "/collective_rpc", bearer),
            ("POST", door + "/reset_prefix_cache", bearer),
            ("POST", door + "/v1/load_lora_adapter", bearer),
            ("GET", door + "/slots", bearer),
            ("GET", door + "/props", bearer),
            ("GET", door + "/v1/../slots", bearer),
            ("GET", door + "/%2e%2e/slots", bearer),
            # the engine's own address is the other host's loopback: nothing there
            ("GET", f"http://{ENGINE_ADDRESS}:{port}/v1/models", bearer),
        ])
        assert unreachable[:9] == [404] * 9
        assert unreachable[9] == "ConnectError"

        # the platform's own callers: a gateway holding the engine's key reads what it needs
        admitted = _from_other_host(ns, [
            ("GET", door + "/health", bearer),
            ("GET", door + "/metrics", bearer),
            ("GET", door + "/v1/models", bearer),
        ])
        assert admitted == [200, 200, 200]

        # the platform's path: the gateway, with the endpoint's key
        r = httpx.post(st.gateway_url + "/v1/chat/completions", json=chat, timeout=60,
                       headers={"Authorization": f"Bearer {mine['api_key']}"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"]

        # on the node itself the engine still asks for its own key (llama.cpp's guard)
        assert httpx.get(f"http://{ENGINE_ADDRESS}:{port}/v1/models").status_code == 401
        assert httpx.get(f"http://{ENGINE_ADDRESS}:{port}/v1/models",
                         headers=bearer).status_code == 200

        # the key is in no command line and no log line
        for proc in psutil.process_iter(["cmdline"]):
            assert not any(key in a for a in proc.info["cmdline"] or [])
        logs = [p.log for p in st.procs] + list((st.tmp / "agent" / "logs").glob("*.log"))
        assert len(logs) > 3 and all(key not in p.read_text(errors="replace") for p in logs)
