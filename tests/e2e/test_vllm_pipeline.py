"""One model across two nodes (issue 32 item 3, G1): vLLM's CPU build with pipeline
parallelism 2, its multi-node executor (no Ray), each stage started by the agent of its
own node — two network namespaces on a bridge, as two machines — and the gateway sending
requests to rank 0 alone.

The server and the gateway run in this namespace; an agent (process runtime, vLLM's CPU
build) in each node's namespace. The group is a ``pipeline`` of ``world_size`` 2: the
scheduler places one stage per node (all or nothing), rank 0's node books the
rendezvous port, and each agent builds its stage's command from its claim — rank 0
serves the API behind its door, rank 1 runs headless. The model is ``tiny_hf``'s with a
second, pass-through layer (vLLM gives each stage a share of the layers: with one layer
the second stage has none and cannot size its KV cache).

Two settings the run needs, both said in docs/engines.md: the host name of these
namespaces resolves to 127.0.0.1, so gloo would offer the peers a loopback address
(``GLOO_SOCKET_IFNAME=eth0``, in the task's env, which the operator allows here); and
``--enforce-eager`` is not used — on vLLM 0.32's CPU build eager mode skips the warm-up
that allocates a later stage's buffer for the activations it receives (the first request
fails with ``assert self.intermediate_tensors is not None``), so the stages trace the
model once with the eager backend instead (``--compilation-config``).

Slow where the machine is loaded (two vLLM servers on 2 cores take minutes to start);
skipped without root and ``ip`` (``HETEROFLOW_REQUIRE_NETNS=1`` fails instead) and
without vLLM's CPU build (``HETEROFLOW_REQUIRE_VLLM=1`` fails instead).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from heteroflow.models.tiny_hf import EXPECTED, TINY_HF_DIR_NAME, write_tiny_hf
from tests.conftest import free_port
from tests.netns import network

from .conftest import ADMIN_PASSWORD, GATEWAY_TOKEN, NODE_TOKEN, Stack, spawn, wait_for
from .test_vllm_real import vllm_python

pytestmark = pytest.mark.e2e

MODEL = "tiny-pp"
EAGER_TRACE = json.dumps({"mode": 2, "backend": "eager"})
ENGINE_ARGS = [
    "--max-model-len", "256", "--max-num-seqs", "4", "--dtype", "float32",
    "--compilation-config", EAGER_TRACE,
]
START_S = 900  # two vLLM servers on a busy 2-core machine


def _routed(gateway: str, key: str) -> bool:
    r = httpx.post(gateway + "/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "prompt": "Once upon", "max_tokens": 2})
    return r.status_code == 200


@pytest.mark.feature("G1")
def test_vllm_serves_one_model_from_two_nodes_and_the_gateway_calls_rank_0(
    tmp_path: Path,
) -> None:
    python = vllm_python()
    models = tmp_path / "models"
    model_dir = write_tiny_hf(models / TINY_HF_DIR_NAME, layers=2)
    (tmp_path / "node.json").write_text(json.dumps({"allowed_volume_prefixes": [str(models)]}))
    pool = random.randint(22000, 31000)
    with network(2) as net:
        server_url = f"http://{net.host_ip}:{free_port()}"
        gateway_url = f"http://127.0.0.1:{free_port()}"
        st = Stack(tmp_path, models, model_dir, server_url, gateway_url)
        try:
            st.procs.append(spawn("server", [
                "server", "--host", net.host_ip, "--port", server_url.rsplit(":", 1)[1],
            ], {
                "HETEROFLOW_DATA_DIR": str(tmp_path / "server"),
                "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
                "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
                "HETEROFLOW_GATEWAY_TOKEN": GATEWAY_TOKEN,
                "HETEROFLOW_PORT_POOL_START": str(pool),
                "HETEROFLOW_PORT_POOL_END": str(pool + 40),
                "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
                "HETEROFLOW_SNAPSHOT_INTERVAL_S": "0.2",
                "HETEROFLOW_TASK_ENV_ALLOW": "GLOO_SOCKET_IFNAME",
            }, tmp_path))
            wait_for(lambda: httpx.get(server_url + "/healthz", timeout=1).status_code == 200,
                     60, "server /healthz")
            st.procs.append(spawn("gateway", [
                "gateway", "--server", server_url, "--token", GATEWAY_TOKEN,
                "--port", gateway_url.rsplit(":", 1)[1],
            ], {}, tmp_path))
            for i, (ns, address) in enumerate(net.nodes, 1):
                st.procs.append(spawn(f"agent-{i}", ["agent"], {
                    "HETEROFLOW_AGENT_SERVER_URL": server_url,
                    "HETEROFLOW_AGENT_NODE_TOKEN": NODE_TOKEN,
                    "HETEROFLOW_AGENT_NODE_NAME": f"node-{i}",
                    "HETEROFLOW_AGENT_ADDRESS": address,
                    "HETEROFLOW_AGENT_CONFIG_FILE": str(tmp_path / "node.json"),
                    "HETEROFLOW_AGENT_WORK_DIR": str(tmp_path / f"agent-{i}"),
                    "HETEROFLOW_AGENT_HEARTBEAT_INTERVAL_S": "0.3",
                    "HETEROFLOW_AGENT_RUNTIME": "process",
                    "HETEROFLOW_AGENT_VLLM_PYTHON": python,
                }, tmp_path, prefix=("ip", "netns", "exec", ns)))
            r = httpx.post(server_url + "/api/v1/auth/login",
                           json={"username": "admin", "password": ADMIN_PASSWORD})
            st.token = r.json()["access_token"]
            wait_for(lambda: len(st.api("GET", "/api/v1/nodes").json()) == 2, 60, "2 nodes")
            body: dict[str, Any] = {
                "name": "pp",
                "model_name": MODEL,
                "parallelism": "pipeline",
                "world_size": 2,
                "health_check": {"interval_seconds": 1, "start_period_seconds": START_S},
                "task": {
                    "engine": "vllm", "image": "vllm/vllm-openai:v0.32.0", "gpu_required": 0,
                    "model_path": str(model_dir), "memory_mb": 2048,
                    "engine_args": ENGINE_ARGS,
                    "env": ["VLLM_NO_USAGE_STATS=1", "GLOO_SOCKET_IFNAME=eth0"],
                },
            }
            g = st.api("POST", "/api/v1/task-groups", json=body)
            assert g.status_code == 201, g.text
            group = st.wait_status(g.json()["id"], "running", timeout_s=START_S)
            tasks = sorted(group["tasks"], key=lambda t: t["rank"])
            assert len({t["node_id"] for t in tasks}) == 2, tasks  # one stage per node
            key = g.json()["api_key"]
            wait_for(lambda: _routed(gateway_url, key), 60, "the gateway to route")

            client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=key, max_retries=0,
                                   timeout=60)
            for _ in range(4):  # every one answered: no request went to the headless stage
                out = client.completions.create(model=MODEL, prompt="Once upon",
                                                max_tokens=16, temperature=0)
                assert out.choices[0].text == EXPECTED["completion"], out
        except BaseException:
            print(st.logs())
            for log in sorted(tmp_path.glob("agent-*/logs/*.log")):
                print(f"----- {log} -----\n{log.read_text(errors='replace')[-6000:]}")
            raise
        finally:
            for p in reversed(st.procs):
                p.stop()
