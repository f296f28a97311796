"""One container recipe: the ``ContainerPlan`` of a task on a node, built in one place.

``container_plan(task, node, work_dir_config=...)`` is pure: what the task says
(``TaskShape``) and what the node gives (``NodeShape``: the address its ports are
published on, the vendor of each card) in, the plan and the engine's config files out.
The agent launches the plan and writes the files (``agent.container_launch``); the dry
run shows the same plan with placeholder ids and the placement's node
(``services.dry_run``), so the two cannot disagree. What needs the node's files — the
model and volume allow-list checks (C4, A2), the engine version probe — stays with the
agent; their results come in as inputs (``TaskShape.engine_version``).

Errors are ``ValueError`` (``CommandError`` for a shape the command builder refuses, a
plain ``ValueError`` for a card vendor with no known GPU arguments).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from heteroflow.core.containers import (
    HARDENED,
    ContainerPlan,
    Mount,
    container_env,
    gpu_request,
    model_mount,
    shared_memory,
)
from heteroflow.core.engine_access import ENGINE_ADDRESS, door_port
from heteroflow.core.engines.commands import CommandError, LaunchShape, build_command
from heteroflow.core.engines.kv_offload import parse_version
from heteroflow.core.engines.registry import DEFAULT_CONTAINER_PORT
from heteroflow.core.engines.sleep import sleep_mode
from heteroflow.core.gang import GangPlace, gang_env, stage_shape
from heteroflow.core.ports import PortMapping
from heteroflow.core.volumes import Volume, volumes_of

__all__ = [
    "ConfigFile",
    "NodeShape",
    "RecipeResult",
    "TaskShape",
    "container_plan",
    "image_tag_version",
    "task_labels",
]


@dataclass(frozen=True)
class TaskShape:
    """What the task says, as the agent's assignment (or the dry run's plan) gives it."""

    id: str
    group_id: str
    name: str
    image: str
    engine: str
    model_path: str = ""
    model_name: str = ""
    command: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    ports: tuple[PortMapping, ...] = ()
    parallelism: str = "single"
    gpu_required: int = 0
    gpu_ids: tuple[int, ...] = ()
    gpu_memory_utilization: int = 90
    kv_offload_gb: int = 0
    engine_version: str = ""  # the image's engine version, where the task needs it (C12)
    generation: int = 1
    task_type: str = "inference"
    max_loras: int = 0  # LoRA adapter slots (core.lora): the engine's flags
    # A2: the task's own bind mounts (rows and wire models hold dicts: made Volumes here)
    volumes: tuple[Volume, ...] = ()
    # G1: a pipeline stage's rank, world size and rendezvous (core.gang; the wire's dict
    # is made a GangPlace here); None outside a gang
    gang: GangPlace | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "volumes", volumes_of(self.volumes))
        object.__setattr__(self, "gang", GangPlace.of(self.gang))

    @classmethod
    def of(cls, task: object, **given: Any) -> TaskShape:
        """The one constructor: each field from ``given``, else ``task``'s attribute of the
        same name (a list becomes a tuple), else its default. The agent shapes its
        assignment, the dry run the group's spec with the planned values given (as the
        create writes its rows), so a field added here is read by both."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in given:
                values[f.name] = given[f.name]
            elif hasattr(task, f.name):
                value = getattr(task, f.name)
                values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


@dataclass(frozen=True)
class NodeShape:
    """What the node gives: where published ports listen, and each card's vendor."""

    address: str
    card_vendors: Mapping[int, str] = field(default_factory=dict)
    # C14: where an engine's API port is published instead (the node's private loopback);
    # the agent's door listens on ``address`` at the same port number
    engine_address: str = ENGINE_ADDRESS


@dataclass(frozen=True)
class ConfigFile:
    """A file the engine reads (MindIE's config.json): written by the agent at ``source``
    on the host, mounted read-only at ``target`` in the container."""

    source: str
    target: str
    content: str


@dataclass(frozen=True)
class RecipeResult:
    plan: ContainerPlan
    config_files: tuple[ConfigFile, ...] = ()


def task_labels(task: TaskShape) -> dict[str, str]:
    """The labels that tie a container to its task (adoption and zombie cleanup read them)."""
    return {
        "heteroflow.task": task.id,
        "heteroflow.group": task.group_id,
        "heteroflow.generation": str(task.generation),
        "heteroflow.engine": task.engine,
    }


def image_tag_version(image: str) -> str:
    """The version an image's tag names (``vllm/vllm-openai:v0.11.2`` -> ``0.11.2``), or ""
    when the tag is not a version (``latest``, none). The server's best guess for a dry
    run; the agent reads the image itself (label or probe) before it launches."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return ""
    tag = last.rsplit(":", 1)[1]
    try:
        parse_version(tag)
    except CommandError:
        return ""
    return tag.removeprefix("v")


def _listen(task: TaskShape, node: NodeShape) -> dict[str, Any]:
    """Where the engine listens: its container port, behind the published mapping — but
    a gang's stage is on the host network (C5), where nothing translates ports, so it
    binds its booked host port itself, on the engine address behind the node's door
    (C14; only rank 0 serves one)."""
    if task.gang is None or not task.ports:
        port = task.ports[0].container_port if task.ports else DEFAULT_CONTAINER_PORT
        return {"port": port}
    first = task.ports[0]  # not placed yet (a dry run): the container port stands in
    return {"port": first.host_port or first.container_port, "host": node.engine_address}


def container_plan(task: TaskShape, node: NodeShape, *, work_dir_config: str) -> RecipeResult:
    """The container of ``task`` on ``node``; ``work_dir_config`` is the host folder under
    which the agent writes engine config files (``<work_dir>/config``)."""
    vendor = next((node.card_vendors[i] for i in task.gpu_ids if i in node.card_vendors), "")
    gpu = gpu_request(vendor, task.gpu_ids) if vendor else None
    mount, engine_path = model_mount(task.model_path, task.engine)
    # the model, then the task's volumes (read-only unless asked: core.volumes checked them)
    mounts: list[Mount] = [mount] if mount else []
    mounts.extend(v.mount() for v in task.volumes)
    files: list[ConfigFile] = []
    entrypoint: tuple[str, ...] | None
    env_defaults: dict[str, str] = {}
    if task.command:
        entrypoint, args, engine_env = None, task.command, {}
    elif not task.engine:
        raise CommandError(
            "no engine resolved yet: the node's engine chain picks one when the task is "
            "placed (H1)"
        )
    else:
        cmd = build_command(
            LaunchShape(
                engine=task.engine,
                model_path=engine_path,
                served_model_name=task.model_name,
                **_listen(task, node),
                parallelism=task.parallelism,
                gpus=task.gpu_required,
                tensor_parallel_size=task.gpu_required
                if task.parallelism == "tensor_parallel"
                else 1,
                gpu_memory_utilization=task.gpu_memory_utilization,
                extra_args=task.engine_args,
                kv_offload_gb=task.kv_offload_gb,
                engine_version=task.engine_version,
                max_loras=task.max_loras,
                sleep_mode=sleep_mode(
                    task.engine, vendor, task.engine_version, parallelism=task.parallelism
                ).kept,
                **stage_shape(task.gang, node.address),
            )
        )
        entrypoint, args, engine_env = cmd.entrypoint, cmd.args, dict(cmd.env)
        env_defaults = dict(cmd.env_defaults)
        for target, content in cmd.config_files.items():
            source = posixpath.join(work_dir_config, task.id, target.lstrip("/"))
            files.append(ConfigFile(source, target, content))
            mounts.append(Mount(source, target))
    ipc, shm, network = shared_memory(task.parallelism, task.gpu_required, task.engine)
    behind = door_port(
        task.task_type, task.parallelism, task.ports[0].host_port if task.ports else 0,
        task.gang.rank if task.gang else 0,
    )
    plan = ContainerPlan(
        name=task.id,
        image=task.image,
        entrypoint=entrypoint,
        command=tuple(args),
        env=container_env(
            task.env,
            task_id=task.id,
            group_id=task.group_id,
            task_name=task.name,
            engine=task.engine,
            engine_env=engine_env,
            gpu=gpu,
            engine_defaults=env_defaults,
            gang=gang_env(task.gang, task.gpu_ids, task.ports),
        ),
        ports={  # a gang's rendezvous (no container port) is bound on the host network
            p.container_port: (
                node.engine_address if p.host_port == behind else node.address, p.host_port
            )
            for p in task.ports
            if p.container_port
        },
        mounts=tuple(mounts),
        ipc_mode=ipc,
        shm_size=shm,
        network_mode=network,
        gpu=gpu,
        labels=task_labels(task),
        security=HARDENED,
    )
    return RecipeResult(plan, tuple(files))
