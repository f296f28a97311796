"""The locally built llama.cpp image serves the tiny model under the Docker runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.core.containers import Mount
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.testing.engine_image import ENGINE_ENTRYPOINT, HASH_LABEL, ensure_engine_image
from tests.conftest import free_port
from tests.docker.conftest import make_plan, wait_until


@pytest.mark.feature("C13", "C4")
def test_engine_image_serves_chat(
    runtime: DockerRuntime, engine_image: str, docker_client: Any, tmp_path: Path
) -> None:
    image = docker_client.images.get(engine_image)
    assert image.attrs["Config"]["Entrypoint"] == list(ENGINE_ENTRYPOINT)
    assert HASH_LABEL in image.labels
    assert ensure_engine_image(docker_client) == engine_image  # cached: nothing rebuilt
    assert docker_client.images.get(engine_image).id == image.id

    write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    port = free_port()
    args = ("-m", "/models/tiny.gguf", "--host", "0.0.0.0", "--port", "8000", "--alias", "tiny")
    plan = make_plan(
        engine_image,
        args,
        ports={8000: ("127.0.0.1", port)},
        mounts=(Mount(str(tmp_path / "models"), "/models"),),
    )
    runtime.start(plan)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            assert runtime.exit_code(plan.name) is None, runtime.log_tail(plan.name, 30)
            return False

    wait_until(healthy, 30, "the engine's /health")
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == "tiny"
    assert body["usage"]["completion_tokens"] == 4
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert "llama.cpp server listening on" in runtime.log_tail(plan.name, 200)
    runtime.stop(plan.name, timeout_s=10)
    assert runtime.exit_code(plan.name) == -1
