"""Turns a task assignment into what the process runtime starts.

Under the process runtime ``image`` is recorded but the engine's local launcher runs:
llama.cpp through ``heteroflow.engines.llamacpp_server`` with llama-server's own flag
spelling, listening on 127.0.0.1 on the allocated host port that stands for the
container port. Engines that exist only as container images (vLLM, SGLang, ...) need
the Docker runtime and fail here with that reason rather than pretending.
"""

from __future__ import annotations

import sys
from pathlib import Path

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.models import ModelPathError, resolve_model_file
from heteroflow.agent.runtime.protocol import LaunchFailed, LaunchSpec
from heteroflow.core.engines import LLAMACPP_AGENT_FLAGS, owned_flag_in
from heteroflow.schemas.nodes import TaskAssignment

# Variables the agent owns: user values with these names are dropped (FEATURES C3).
AGENT_OWNED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
        "ASCEND_VISIBLE_DEVICES",
        "MUSA_VISIBLE_DEVICES",
        "HETEROFLOW_TASK_ID",
        "HETEROFLOW_GROUP_ID",
        "HETEROFLOW_TASK_NAME",
    }
)


def task_env(t: TaskAssignment) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in t.env:
        if "=" not in item:
            continue  # a bare name carries no value: dropped
        name, value = item.split("=", 1)
        if name and name not in AGENT_OWNED_ENV:
            env[name] = value
    visible = ",".join(str(i) for i in t.gpu_ids)
    env["CUDA_VISIBLE_DEVICES"] = visible
    env["HETEROFLOW_TASK_ID"] = t.id
    env["HETEROFLOW_GROUP_ID"] = t.group_id
    env["HETEROFLOW_TASK_NAME"] = t.name
    return env


def host_port_for(t: TaskAssignment, container_port: int | None = None) -> int:
    """The host port standing for a container port (the first mapping by default)."""
    for p in t.ports:
        if container_port is None or p["container_port"] == container_port:
            return int(p["host_port"])
    raise LaunchFailed(f"task has no mapping for container port {container_port}")


def build_launch(
    t: TaskAssignment, config: NodeConfig, *, cpu_threads: int, log_dir: Path
) -> LaunchSpec:
    env = task_env(t)
    host_ports = tuple(int(p["host_port"]) for p in t.ports if p.get("host_port"))
    port = host_port_for(t)
    log_path = log_dir / f"{t.id}.log"
    if t.command:
        env["PORT"] = str(port)
        return LaunchSpec(t.id, tuple(t.command), env, host_ports, log_path)
    if t.engine != "llamacpp":
        raise LaunchFailed(
            f"engine {t.engine or '(none)'} needs a container runtime; this node runs the "
            "process runtime, which can start llama.cpp only"
        )
    clash = owned_flag_in(t.engine_args, LLAMACPP_AGENT_FLAGS)
    if clash:
        raise LaunchFailed(f"engine_args may not set {clash}: the agent sets it")
    if "," in t.model_name:
        raise LaunchFailed("model name may not contain ',' (llama-server reads a list)")
    try:
        model = resolve_model_file(
            t.model_path, config.allowed_volume_prefixes, config.denied_volume_prefixes
        )
    except ModelPathError as exc:
        raise LaunchFailed(str(exc)) from exc
    argv = [
        sys.executable, "-m", "heteroflow.engines.llamacpp_server",
        "-m", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--alias", t.model_name,
    ]
    if cpu_threads and not {"-t", "--threads"} & set(t.engine_args):
        argv += ["-t", str(cpu_threads)]
    argv += t.engine_args
    return LaunchSpec(t.id, tuple(argv), env, host_ports, log_path)
