"""``heteroflow models`` end to end (issue 29, H9): real server, agent and gateway processes,
the real CLI, and the stand-in hub (``testing.model_hub``: no test machine reaches a hub)
as the agent's Hugging Face endpoint.

A pull goes to the node's agent, lands in its cache, the node's heartbeat reports it and
``models list`` shows it; an eviction removes it and the list forgets it. A model a running
service uses (a GGUF served by the hub's plain file route, fetched at the launch and
served by the real llama.cpp) is refused eviction with the reason, exit 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from heteroflow.core.model_sources import parse_model_source
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.testing.model_hub import COMMIT, ModelHub, Repo, serving

from .conftest import ADMIN_PASSWORD, Stack, launch_stack, wait_for

pytestmark = pytest.mark.e2e

NODE = "e2e-models-node"
TOKEN = "hf_e2eSECRETpulltoken0123456789"
WEIGHTS = bytes(range(256)) * 2048  # 512 KiB


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()
    hub = ModelHub(
        repos={"org/tiny": Repo({"config.json": b'{"model_type": "llama"}',
                                 "model.safetensors": WEIGHTS},
                                lfs=frozenset({"model.safetensors"}), token=TOKEN)},
        files={"m/tiny-served.gguf": gguf},
    )
    with serving(hub) as url:
        yield url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, hub: str) -> Iterator[Stack]:
    with launch_stack(
        tmp_path_factory.mktemp("e2e-models"),
        node_name=NODE,
        server_env={"HETEROFLOW_DATABASE_URL": os.environ.get("HETEROFLOW_E2E_DATABASE_URL", "")},
        agent_env={
            "HETEROFLOW_AGENT_HF_ENDPOINT": hub,
            "HETEROFLOW_AGENT_HUB_TOKEN": TOKEN,  # the repo is private: only with it
            "HETEROFLOW_AGENT_LOG_SHIP_INTERVAL_S": "0.3",  # the poll of model requests
            "HETEROFLOW_AGENT_IMAGE_PULL_REPORT_INTERVAL_S": "0.2",
        },
    ) as st:
        yield st


def cli(stack: Stack, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HETEROFLOW_CLI_DIR": str(stack.tmp / "cli"),
           "HETEROFLOW_PASSWORD": ADMIN_PASSWORD}
    r = subprocess.run([sys.executable, "-m", "heteroflow.cli", *args], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == code, r.stdout + r.stderr
    return r


def listed(stack: Stack) -> str:
    return cli(stack, "models", "list", "--node", NODE).stdout


def cache_dir(stack: Stack) -> Path:
    return stack.tmp / "agent" / "models"


@pytest.mark.feature("H9")
def test_pull_lists_evicts_and_a_model_in_use_is_refused(stack: Stack, hub: str) -> None:
    cli(stack, "login", "--server", stack.server_url)
    key = parse_model_source(f"hf://org/tiny@{COMMIT}").cache_key
    assert listed(stack) == "no cached models\n"

    out = cli(stack, "models", "pull", "hf://org/tiny", "--node", NODE, "--wait").stdout
    assert out.splitlines()[0].endswith(f"pull of hf://org/tiny@main on node {NODE} (pending)")
    assert f"done: hf://org/tiny@main is in this node's cache as {key}" in out, out
    assert TOKEN not in out
    assert (cache_dir(stack) / key / "model.safetensors").read_bytes() == WEIGHTS
    # the node's heartbeat reports it; the list is the server's, from that report
    row = wait_for(lambda: [ln for ln in listed(stack).splitlines() if key in ln], 30,
                   "the pulled model in `models list`")
    assert row[0].split()[:4] == [NODE, key, "hf://org/tiny@main", COMMIT[:12]], row
    assert row[0].split()[-1] == "complete"

    out = cli(stack, "models", "evict", key, "--node", NODE, "--wait").stdout
    assert f"done: {key} evicted from this node's cache" in out, out
    assert not (cache_dir(stack) / key).exists()
    wait_for(lambda: key not in listed(stack), 30, "the evicted model gone from the list")

    # a model a running service uses: fetched at its launch, pinned while it runs
    source = f"{hub}/files/m/tiny-served.gguf"
    g = stack.api("POST", "/api/v1/task-groups", json={
        "name": "uses-it", "model_name": "uses-it",
        "task": {"image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0,
                 "model_path": source},
    })
    assert g.status_code == 201, g.text
    stack.wait_status(g.json()["id"], "running", timeout_s=120)
    served = parse_model_source(source).cache_key
    wait_for(lambda: served in listed(stack), 30, "the service's model in `models list`")
    r = cli(stack, "models", "evict", served, "--node", NODE, "--wait", code=1)
    assert f"evict of {served} on node {NODE} failed: refused:" in r.stderr, r.stderr
    assert "in use" in r.stderr
    assert (cache_dir(stack) / served / "tiny-served.gguf").is_file()
    assert stack.api("DELETE", f"/api/v1/task-groups/{g.json()['id']}").status_code == 204

    # the node's log never shows the hub token either
    assert TOKEN not in stack.logs()
    agent_log = next(p for p in stack.procs if p.name == "agent").log.read_text()
    assert TOKEN not in agent_log
