"""The engine probe against a real Docker Engine: exact reference with tag (C9)."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.agent.engine_probe import DockerImageStore, probe_engines
from heteroflow.agent.inventory import GpuCard

A10 = GpuCard(
    index=0,
    uuid="declared-0",
    vendor="nvidia",
    model="A10",
    memory_total_mb=24576,
    memory_used_mb=0,
    compute_capability="8.6",
    mig_capable=False,
    mps_capable=True,
    temperature_c=None,
    source="declared",
)


@pytest.mark.feature("C9")
def test_only_the_exact_tag_counts_and_a_prefixed_copy_warns(
    docker_client: Any, busybox_image: str
) -> None:
    image = docker_client.images.get(busybox_image)
    image.tag("registry.example.com/vllm/vllm-openai", "v0.11.2")
    image.tag("lmsysorg/sglang", "v0.5.5")
    try:
        result = probe_engines(
            DockerImageStore(docker_client),
            {"vllm": "vllm/vllm-openai:v0.11.2", "sglang": "lmsysorg/sglang:v0.5.5"},
            [A10],
            lambda dist: False,
        )
        assert result.available == {"sglang": "lmsysorg/sglang:v0.5.5"}
        assert any(
            "docker tag registry.example.com/vllm/vllm-openai:v0.11.2 vllm/vllm-openai:v0.11.2" in w
            for w in result.warnings
        )
        # the operator follows the advice: now it counts
        image.tag("vllm/vllm-openai", "v0.11.2")
        again = probe_engines(
            DockerImageStore(docker_client),
            {"vllm": "vllm/vllm-openai:v0.11.2"},
            [A10],
            lambda dist: False,
        )
        assert again.available == {"vllm": "vllm/vllm-openai:v0.11.2"}
    finally:
        for ref in (
            "registry.example.com/vllm/vllm-openai:v0.11.2",
            "lmsysorg/sglang:v0.5.5",
            "vllm/vllm-openai:v0.11.2",
        ):
            try:
                docker_client.images.remove(ref)
            except Exception:  # noqa: S112 - the tag may not exist
                continue
