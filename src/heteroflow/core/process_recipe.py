"""What the process runtime starts for a task: one function, ``process_launch``, for the
agent's launch (agent/launch.py) and the dry run (services/placement/dry_run.py), as
``core.recipe.container_plan`` is for containers.

The task's side is the recipe's ``TaskShape``; the node's side is what only the node
knows (``ProcessNode``): the interpreters its engines run on, its thread setting, the
engine address, and the model resolved on its file system. The agent passes its own; the
dry run passes what the server knows and placeholders for the rest (``AGENT_PYTHON``,
``VLLM_PYTHON``: the agent's Python and ``HETEROFLOW_AGENT_VLLM_PYTHON``), so the argv it
shows is the agent's, word for word, but for those.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.core.containers import PROCESS_BASE_ENV, container_env
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.core.engines.commands import (
    LLAMACPP_AGENT_FLAGS,
    CommandError,
    EngineCommand,
    LaunchShape,
    owned_flag_in,
    process_command,
)
from heteroflow.core.gang import gang_env, stage_shape
from heteroflow.core.recipe import TaskShape

#: The dry run's stand-ins for what only the node knows.
AGENT_PYTHON = "<agent-python>"
VLLM_PYTHON = "<vllm-python>"


@dataclass(frozen=True, slots=True)
class ProcessNode:
    """What only the node knows of a process launch."""

    python: str = AGENT_PYTHON  # the agent's own interpreter: llama.cpp's launcher runs on it
    vllm_python: str = VLLM_PYTHON  # the interpreter the node's vLLM runs on
    cpu_threads: int = 0  # the agent's cpu_threads (0: the engine's own default)
    host: str = ENGINE_ADDRESS  # where the engine listens (behind the node's door, C14)
    # the node's own address, where a pipeline stage's peers reach it (G1; "" outside a gang)
    address: str = ""


def process_launch(
    task: TaskShape, *, model: str, port: int, node: ProcessNode, sleep_mode: bool = False
) -> EngineCommand:
    """The command the process runtime starts for ``task`` (its whole argv in ``args``):
    ``model`` as resolved on the node, on host ``port``. CommandError for what it will
    not start (an engine it has no launcher for, a flag the agent sets)."""
    if task.engine == "llamacpp":
        clash = owned_flag_in(task.engine_args, LLAMACPP_AGENT_FLAGS)
        if clash:
            raise CommandError(f"engine_args may not set {clash}: the agent sets it")
        extra = list(task.engine_args)
        if node.cpu_threads and not {"-t", "--threads"} & set(extra):
            extra += ["-t", str(node.cpu_threads)]
        shape = LaunchShape(
            engine="llamacpp", model_path=model, served_model_name=task.model_name,
            port=port, host=node.host, gpus=task.gpu_required, extra_args=tuple(extra),
        )
        return process_command(shape, node.python)
    if task.engine == "vllm":
        tp = task.gpu_required if task.parallelism == "tensor_parallel" else 1
        shape = LaunchShape(
            engine="vllm", model_path=model, served_model_name=task.model_name, port=port,
            host=node.host, parallelism=task.parallelism, gpus=task.gpu_required,
            tensor_parallel_size=tp, gpu_memory_utilization=task.gpu_memory_utilization,
            extra_args=task.engine_args, kv_offload_gb=task.kv_offload_gb,
            max_loras=task.max_loras, sleep_mode=sleep_mode,
            **stage_shape(task.gang, node.address),
        )
        return process_command(shape, node.vllm_python)
    return process_command(  # its refusal, in its own words
        LaunchShape(engine=task.engine, model_path=model, served_model_name="", port=port),
        node.python,
    )


def process_env(task: TaskShape, cmd: EngineCommand | None = None) -> dict[str, str]:
    """The whole environment of an engine process but its key (the agent adds that, C14):
    a clean base, the recipe's variables (``cmd``) under the C3 rules, and the CUDA
    visibility a process (not a container) needs."""
    env = dict(PROCESS_BASE_ENV)
    env |= container_env(
        task.env,
        task_id=task.id,
        group_id=task.group_id,
        task_name=task.name,
        engine=task.engine,
        engine_env=dict(cmd.env) if cmd else {},
        gpu=None,
        engine_defaults=dict(cmd.env_defaults) if cmd else {},
        gang=gang_env(task.gang, task.gpu_ids, task.ports),  # G1: as core.recipe's
    )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in task.gpu_ids)
    return env
