"""Copies between nodes across a network (issue 29 item 4, H9): two nodes in their own
network namespaces; the model's origin is a web server only node 1 can reach (on its own
loopback: the air-gapped fleet, where an operator loaded the model onto one node). Node 1
serves a service from it; a service that names the copy (``fleet://<key>``) and has to
start on node 2 gets the model from node 1's agent over the bridge, and answers a chat
through the gateway. Real processes: a server, a gateway, two agents, llama.cpp.

Needs root and ``ip`` (iproute2); skipped without them unless
``HETEROFLOW_REQUIRE_NETNS=1`` (``.ci/run``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.conftest import free_port
from tests.netns import network

from .conftest import ADMIN_PASSWORD, GATEWAY_TOKEN, NODE_TOKEN, Proc, Stack, spawn, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.feature("H9")]


def _agent_env(server: str, name: str, address: str, tmp: Path) -> dict[str, str]:
    return {
        "HETEROFLOW_AGENT_SERVER_URL": server,
        "HETEROFLOW_AGENT_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_AGENT_NODE_NAME": name,
        "HETEROFLOW_AGENT_ADDRESS": address,
        "HETEROFLOW_AGENT_CONFIG_FILE": str(tmp / "node.json"),
        "HETEROFLOW_AGENT_WORK_DIR": str(tmp / name),
        "HETEROFLOW_AGENT_HEARTBEAT_INTERVAL_S": "0.3",
        "HETEROFLOW_AGENT_CPU_THREADS": "1",
        "HETEROFLOW_AGENT_RUNTIME": "process",
        "HETEROFLOW_AGENT_PEER_PORT": "0",  # any free port: reported in the heartbeat
    }


def _service(st: Stack, name: str, model_path: str, memory_mb: int) -> dict[str, Any]:
    body = {
        "name": name, "model_name": f"{name}-model",
        "health_check": {"interval_seconds": 0.5, "start_period_seconds": 30},
        "task": {"image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0,
                 "model_path": model_path, "memory_mb": memory_mb,
                 "engine_args": ["-np", "1", "-c", "512"]},
    }
    r = st.api("POST", "/api/v1/task-groups", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_a_node_copies_a_model_another_node_holds_over_the_network(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    write_tiny_gguf(origin / "tiny.gguf")
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "node.json").write_text(json.dumps({"model_scan_dirs": [str(models)]}))
    with network(2) as net:
        (ns1, addr1), (ns2, addr2) = net.nodes
        server = f"http://{net.host_ip}:{free_port()}"
        gateway = f"http://127.0.0.1:{free_port()}"
        procs: list[Proc] = []
        st = Stack(tmp_path, models, origin / "tiny.gguf", server, gateway)
        try:
            procs.append(spawn("server", ["server", "--host", net.host_ip, "--port",
                                          server.rsplit(":", 1)[1]], {
                "HETEROFLOW_DATA_DIR": str(tmp_path / "server"),
                "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
                "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
                "HETEROFLOW_GATEWAY_TOKEN": GATEWAY_TOKEN,
                "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
                "HETEROFLOW_SNAPSHOT_INTERVAL_S": "0.2",
            }, tmp_path))
            wait_for(lambda: httpx.get(server + "/healthz", timeout=1).status_code == 200,
                     60, "server")
            procs.append(spawn("gateway", ["gateway", "--server", server, "--token",
                                           GATEWAY_TOKEN, "--port", gateway.rsplit(":", 1)[1]],
                               {}, tmp_path))
            # the origin: reachable from node 1 alone (its own loopback)
            port = free_port()
            log = tmp_path / "origin.log"
            procs.append(Proc("origin", subprocess.Popen(
                ["ip", "netns", "exec", ns1, sys.executable, "-m", "http.server", str(port),
                 "--bind", "127.0.0.1", "--directory", str(origin)],
                stdout=log.open("wb"), stderr=subprocess.STDOUT,
            ), log))
            procs.append(spawn("agent-1", ["agent"], _agent_env(server, "node-1", addr1, tmp_path),
                               tmp_path, ("ip", "netns", "exec", ns1)))
            st.procs = procs
            r = httpx.post(server + "/api/v1/auth/login",
                           json={"username": "admin", "password": ADMIN_PASSWORD})
            st.token = r.json()["access_token"]
            node1 = wait_for(lambda: [n for n in st.api("GET", "/api/v1/nodes").json()
                                      if n.get("peer_url")], 60, "node 1 serving copies")[0]
            assert node1["peer_url"].startswith(f"http://{addr1}:")
            # each service takes more than half of what a node may book: two never share one
            half = int(node1["memory_total_mb"] * 0.9 / 2) + 64
            first = _service(st, "first", f"http://127.0.0.1:{port}/tiny.gguf", half)
            st.wait_status(first["id"], "running", 120)

            procs.append(spawn("agent-2", ["agent"], _agent_env(server, "node-2", addr2, tmp_path),
                               tmp_path, ("ip", "netns", "exec", ns2)))

            def held() -> list[dict[str, Any]] | None:
                nodes = st.api("GET", "/api/v1/nodes").json()
                if len(nodes) < 2:
                    return None
                one = next(n for n in nodes if n["name"] == "node-1")
                return [m for m in one["models"] if m.get("state") == "complete"] or None

            (copy,) = wait_for(held, 60, "node 2 registered, node 1's copy reported")
            second = _service(st, "second", f"fleet://{copy['key']}", half)
            g = st.wait_status(second["id"], "running", 120)
            nodes = {n["id"]: n["name"] for n in st.api("GET", "/api/v1/nodes").json()}
            assert [nodes[t["node_id"]] for t in g["tasks"]] == ["node-2"]
            events = st.api("GET", f"/api/v1/task-groups/{second['id']}/events").json()
            fetched = [e["message"] for e in events if e["kind"] == "task.model_fetch"]
            assert any("copied from node node-1" in m for m in fetched), fetched
            # node 2 reports the copy under the same key: placement knows both now
            two = wait_for(lambda: [m for n in st.api("GET", "/api/v1/nodes").json()
                                    if n["name"] == "node-2" for m in n["models"]
                                    if m.get("key") == copy["key"]], 30, "node 2's copy")
            assert two[0]["state"] == "complete"

            def answers() -> bool:
                r = httpx.post(gateway + "/v1/completions", timeout=30,
                               headers={"Authorization": f"Bearer {second['api_key']}"},
                               json={"model": "second-model", "prompt": "hi", "max_tokens": 2})
                return r.status_code == 200 and bool(r.json()["choices"])

            wait_for(answers, 30, "the copied model answering through the gateway")
        finally:
            for p in reversed(procs):
                p.stop()
