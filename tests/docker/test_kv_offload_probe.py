"""C12 on the node: the image's vLLM version picks the offload flags; red lines refuse.

The fixture images below are built locally from the engine image and carry ONLY a
``vllm`` distribution's metadata (a ``vllm-<version>.dist-info/METADATA``) at a chosen
version, plus a ``python3`` link as real vLLM images have — no vLLM code. That is all
the version probe reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import DockerLauncher
from heteroflow.agent.engine_probe import DockerImageStore, engine_version
from heteroflow.agent.inventory import NodeInventory
from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.ids import new_id
from heteroflow.schemas.nodes import TaskAssignment

WRITE_META = (
    "import os, sys; v = sys.argv[1]; d = f'/usr/lib/python3.11/vllm-{v}.dist-info';"
    "os.makedirs(d); open(d + '/METADATA', 'w').write(f'Metadata-Version: 2.1\\nName: vllm\\n"
    "Version: {v}\\n'); os.symlink('/usr/bin/python3.11', '/usr/bin/python3')"
)


def vllm_meta_image(client: Any, engine_image: str, version: str) -> str:
    tag = f"heteroflow-test/vllm-meta:{version}"
    if any(tag in (i.tags or ()) for i in client.images.list()):
        return tag
    c = client.containers.run(
        engine_image, ["-c", WRITE_META, version], entrypoint=["python3.11"], detach=True
    )
    try:
        c.wait(timeout=60)
        repo, tag_part = tag.split(":")
        c.commit(repository=repo, tag=tag_part)
    finally:
        c.remove(force=True)
    return tag


def assignment(image: str, gb: int, model: Path) -> TaskAssignment:
    return TaskAssignment(
        id=new_id("task"),
        group_id="tg-000000000001",
        name="kv",
        status="starting",
        task_type="inference",
        model_name="m",
        model_path=str(model),
        image=image,
        engine="vllm",
        command=[],
        engine_args=[],
        env=[],
        ports=[{"container_port": 8000, "host_port": 0}],
        gpu_ids=[],
        gpu_required=1,
        memory_mb=0,
        kv_offload_gb=gb,
        health_check={},
    )


def launcher(client: Any, tmp_path: Path, memory_mb: int) -> DockerLauncher:
    store = DockerImageStore(client)
    la = DockerLauncher(
        DockerRuntime(client, node_id="kv-node", agent_id="kv-node"),
        NodeConfig(allowed_volume_prefixes=(str(tmp_path),)),
        address="127.0.0.1",
        work_dir=tmp_path,
        version_of=lambda image: engine_version(store, image),
    )
    la.observe(
        NodeInventory(
            gpus=(),
            cpu_count=2,
            memory_total_mb=memory_mb,
            memory_available_mb=memory_mb,
            cpu_percent=0,
            memory_percent=0,
        )
    )
    return la


@pytest.mark.feature("C12", "C9")
def test_the_version_probe_reads_the_images_vllm_metadata(
    docker_client: Any, engine_image: str
) -> None:
    store = DockerImageStore(docker_client)
    for v in ("0.7.3", "0.9.2", "0.11.2"):
        assert engine_version(store, vllm_meta_image(docker_client, engine_image, v)) == v
    assert engine_version(store, engine_image) is None  # no vllm in it at all


@pytest.mark.feature("C12")
def test_offload_flags_follow_the_version_and_refused_versions_fail(
    docker_client: Any, engine_image: str, tmp_path: Path
) -> None:
    model = tmp_path / "m"
    model.mkdir()
    la = launcher(docker_client, tmp_path, memory_mb=64 * 1024)
    old = vllm_meta_image(docker_client, engine_image, "0.7.3")
    t = assignment(old, 8, model)
    try:
        argv = la.launch(t)
        assert "--swap-space" in argv  # V0 engine: per-GPU CPU swap space
    finally:
        la.runtime.remove(t.id)
    refused = assignment(vllm_meta_image(docker_client, engine_image, "0.9.2"), 8, model)
    with pytest.raises(LaunchFailed, match=r"0\.9\.2"):
        la.launch(refused)
    new = assignment(vllm_meta_image(docker_client, engine_image, "0.11.2"), 8, model)
    try:
        argv = la.launch(new)
        assert "--kv-offloading-size" in argv
    finally:
        la.runtime.remove(new.id)


@pytest.mark.feature("C12")
def test_host_memory_red_line_refuses_to_start(
    docker_client: Any, engine_image: str, tmp_path: Path
) -> None:
    model = tmp_path / "m"
    model.mkdir()
    la = launcher(docker_client, tmp_path, memory_mb=8 * 1024)  # 70% = 5.6 GiB
    t = assignment(vllm_meta_image(docker_client, engine_image, "0.11.2"), 8, model)
    with pytest.raises(LaunchFailed, match="refused"):
        la.launch(t)
