"""What a task's container looks like: pure decisions shared by the dry run and runtimes.

Owns FEATURES C3 (environment rules), C5 (shared memory / IPC / host network for
multi-GPU and pipeline containers), the per-vendor GPU runtime arguments and the
model mount (C4's shape; the allow-list check itself runs on the node, where the
files are). The Docker runtime turns a ``ContainerPlan`` into Engine API calls; the
dry run shows it as it is.

GPU arguments per vendor (the spec's table was lost; rebuilt from the vendors' docs):
- nvidia: a device request for the assigned card ids with capability ``gpu`` (what
  ``docker run --gpus '"device=0,1"'`` sends).
- amd / hygon (ROCm / DTK): ``/dev/kfd`` + ``/dev/dri`` and groups ``video``, ``render``;
  visibility through ``HIP_VISIBLE_DEVICES``.
- ascend: ``/dev/davinci{N}`` per card plus ``/dev/davinci_manager``, ``/dev/devmm_svm``,
  ``/dev/hisi_hdc``; ``ASCEND_VISIBLE_DEVICES``.
- musa (Moore Threads): the MT container toolkit reads ``MTHREADS_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DATA_MODELS = "/data/models"
SHM_SIZE = "16g"
VLLM_FAMILY = frozenset({"vllm", "vllm-mtt"})

# Variables the agent owns: user values with these names are dropped (C3).
AGENT_OWNED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
        "ASCEND_VISIBLE_DEVICES",
        "MUSA_VISIBLE_DEVICES",
        "MTHREADS_VISIBLE_DEVICES",
        "HETEROFLOW_TASK_ID",
        "HETEROFLOW_GROUP_ID",
        "HETEROFLOW_TASK_NAME",
        "VLLM_SERVER_DEV_MODE",
    }
)


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class GpuRequest:
    vendor: str
    device_ids: tuple[str, ...] = ()  # nvidia device request
    devices: tuple[str, ...] = ()  # host device paths passed through
    group_add: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerPlan:
    name: str
    image: str
    entrypoint: tuple[str, ...] | None
    command: tuple[str, ...]
    env: Mapping[str, str]
    ports: Mapping[int, tuple[str, int]]  # container port -> (host ip, host port)
    mounts: tuple[Mount, ...]
    ipc_mode: str | None
    shm_size: str | None
    network_mode: str | None
    gpu: GpuRequest | None
    labels: Mapping[str, str]


def gpu_request(vendor: str, gpu_ids: Sequence[int]) -> GpuRequest | None:
    if not gpu_ids:
        return None
    ids = tuple(str(i) for i in gpu_ids)
    csv = ",".join(ids)
    if vendor == "nvidia":
        return GpuRequest(vendor, device_ids=ids)
    if vendor in ("amd", "hygon"):
        return GpuRequest(
            vendor,
            devices=("/dev/kfd", "/dev/dri"),
            group_add=("video", "render"),
            env={"HIP_VISIBLE_DEVICES": csv},
        )
    if vendor == "ascend":
        cards = tuple(f"/dev/davinci{i}" for i in ids)
        return GpuRequest(
            vendor,
            devices=(*cards, "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"),
            env={"ASCEND_VISIBLE_DEVICES": csv},
        )
    if vendor == "musa":
        return GpuRequest(vendor, env={"MTHREADS_VISIBLE_DEVICES": csv})
    raise ValueError(f"no GPU runtime arguments known for vendor {vendor!r}")


def container_env(
    user_env: Sequence[str],
    *,
    task_id: str,
    group_id: str,
    task_name: str,
    engine: str,
    engine_env: Mapping[str, str],
    gpu: GpuRequest | None,
) -> dict[str, str]:
    """C3: bare names dropped, agent-owned names dropped, vLLM dev mode for vLLM only."""
    env: dict[str, str] = {}
    for item in user_env:
        if "=" not in item:
            continue
        name, value = item.split("=", 1)
        if name and name not in AGENT_OWNED_ENV:
            env[name] = value
    for name, value in engine_env.items():
        if name == "VLLM_SERVER_DEV_MODE" and engine not in VLLM_FAMILY:
            continue
        env[name] = value
    if gpu is not None:
        env.update(gpu.env)
    env["HETEROFLOW_TASK_ID"] = task_id
    env["HETEROFLOW_GROUP_ID"] = group_id
    env["HETEROFLOW_TASK_NAME"] = task_name
    return env


def model_mount(model_path: str, engine: str) -> tuple[Mount | None, str]:
    """(mount, the path the engine is given). TensorRT-LLM's engine dir is in its image."""
    if not model_path or engine == "trtllm":
        return None, model_path
    if os.path.isabs(model_path):
        norm = os.path.normpath(model_path)
        return Mount(norm, norm), norm
    name = model_path.strip("/")
    path = f"{DATA_MODELS}/{name}"
    return Mount(path, path), path


def shared_memory(parallelism: str, gpus: int) -> tuple[str | None, str | None, str | None]:
    """(ipc_mode, shm_size, network_mode) — C5.

    Docker's default 64 MB /dev/shm deadlocks multi-process GPU executors (seen on A10
    x2 with TP=2); pipeline stages also need the host network for their rendezvous.
    """
    if parallelism == "pipeline":
        return "host", SHM_SIZE, "host"
    if gpus > 1:
        return "host", SHM_SIZE, None
    return None, None, None
