"""Turns a task assignment into what the process runtime starts.

Under the process runtime ``image`` is recorded but the engine's local install runs:
llama.cpp through ``heteroflow.engines.llamacpp_server`` on the agent's Python, vLLM
through its api_server module on the Python the operator names
(``HETEROFLOW_AGENT_VLLM_PYTHON``, see ``local_engines``), each with the argv built by the
same command builder as containers (``core.engines.commands.process_command``), behind the
node's door (C14) on the allocated host port that stands for the container port. Engines
that exist only as container images here (SGLang, ...) need the Docker runtime and fail
here with that reason rather than pretending.

The process runtime is the trusted single-operator mode: it runs only the platform's own
engine launcher, never a task's ``command`` (that would be a user's program on the host,
as the agent's user) — the scheduler does not place such work here, and this is the
node's own refusal for anything that got past it. The engine starts from a clean
environment (``PROCESS_BASE_ENV``, never the agent's own, which may hold secrets) plus
the task's variables under the C3 rules and the deny-list.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.engine_door import DoorKeeper
from heteroflow.agent.file_requests import process_roots
from heteroflow.agent.inventory import NodeInventory
from heteroflow.agent.local_engines import local_engines
from heteroflow.agent.log_shipper import file_source
from heteroflow.agent.models import (
    ModelPathError,
    model_prefixes,
    resolve_model_dir,
    resolve_model_file,
)
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchFailed, LaunchSpec, Runtime
from heteroflow.core.containers import AGENT_OWNED_ENV
from heteroflow.core.engine_access import ENGINE_ADDRESS, key_env
from heteroflow.core.engines.chat_templates import chat_template_args
from heteroflow.core.engines.commands import CommandError, EngineCommand
from heteroflow.core.engines.registry import CPU_BUILD
from heteroflow.core.engines.sleep import sleep_mode
from heteroflow.core.ports import host_ports as mapped_host_ports
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.process_recipe import ProcessNode, process_env, process_launch
from heteroflow.core.recipe import TaskShape
from heteroflow.models.estimate import gguf_meta_of
from heteroflow.schemas.nodes import TaskAssignment

__all__ = [
    "AGENT_OWNED_ENV",
    "Launcher",
    "NoDoors",
    "ProcessLauncher",
    "build_launch",
    "host_port_for",
    "task_env",
]


class Launcher(Protocol):
    """Starts a task on one runtime; the agent's loops use ``runtime`` for the rest."""

    @property
    def runtime(self) -> Runtime: ...

    def probe_host_for(self, t: TaskAssignment, port: int) -> str:
        """Where the agent reaches a task's host ``port`` (health probes, /sleep): the
        engine itself, never its door."""
        ...

    def keep_doors(self, tasks: list[TaskAssignment]) -> None:
        """C14: the doors of exactly these tasks open (the engines this agent runs or
        keeps asleep); called after each heartbeat's convergence."""
        ...

    def close_doors(self) -> None:
        """Every door closed (the agent stops)."""
        ...

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        """Start the task; returns the argv as launched. LaunchFailed / PortInUse."""
        ...

    def resume(self, t: TaskAssignment) -> tuple[str, ...]:
        """Start a sleeping task's engine again (F2): the kept container (Docker), the
        same argv (process); returns the argv launched, () when unchanged.
        ContainerGone / PortInUse / LaunchFailed."""
        ...

    def engines(self) -> dict[str, str]:
        """Engines this runtime can start here (engine -> image ref, "" for local)."""
        ...

    def observe(self, inv: NodeInventory) -> None:
        """Each heartbeat's inventory (cards for GPU arguments, probe scheduling)."""
        ...

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        """New output of a task since a position; returns (text, next position)."""
        ...

    def file_roots(self, t: TaskAssignment) -> list[str]:
        """Host directories a task mounts: the only places file requests may read."""
        ...


class NoDoors:
    """For launchers whose engines listen on ``probe_host`` itself (test stand-ins)."""

    probe_host = "127.0.0.1"

    def probe_host_for(self, t: TaskAssignment, port: int) -> str:
        return self.probe_host

    def keep_doors(self, tasks: list[TaskAssignment]) -> None:
        pass

    def close_doors(self) -> None:
        pass


def task_env(t: TaskAssignment, cmd: EngineCommand | None = None) -> dict[str, str]:
    """The whole environment of an engine process: a clean base, the recipe's variables
    (``cmd``) under the C3 rules, the CUDA visibility a process (not a container) needs,
    and the engine's key where it reads one (C14)."""
    env = process_env(TaskShape.of(t, ports=ports_from_dicts(t.ports)), cmd)
    return env | key_env(t.engine, t.engine_key)


def host_port_for(t: TaskAssignment, container_port: int | None = None) -> int:
    """The host port standing for a container port (the first mapping by default)."""
    for p in ports_from_dicts(t.ports):
        if container_port is None or p.container_port == container_port:
            return p.host_port
    raise LaunchFailed(f"task has no mapping for container port {container_port}")


def build_launch(
    t: TaskAssignment, config: NodeConfig, *, cpu_threads: int, log_dir: Path,
    host: str = ENGINE_ADDRESS, engines: dict[str, str] | None = None, vllm_python: str = "",
    address: str = "",
) -> LaunchSpec:
    """What the process runtime starts for ``t``; ``engines`` is what this node reports
    (``local_engines``: None = llama.cpp only), ``vllm_python`` the Python vLLM runs on,
    ``address`` the node's own (where a pipeline stage's peers reach it)."""
    if t.command:
        raise LaunchFailed(
            "this node runs the process runtime, which never runs a custom task.command "
            "(it would run on the host): use a node with the Docker runtime"
        )
    if t.volumes:  # A2: the server never places one here (its node gate: no_mounts)
        raise LaunchFailed(
            "this node runs the process runtime, which mounts nothing: task.volumes need "
            "a node with the Docker runtime"
        )
    reported = engines if engines is not None else {"llamacpp": ""}
    node = ProcessNode(
        python=sys.executable, vllm_python=vllm_python, cpu_threads=cpu_threads, host=host,
        address=address,
    )
    sleep = False
    if t.engine == "llamacpp":
        model = _model_file(t, config)
    elif t.engine == "vllm" and "vllm" in reported and vllm_python:
        model = _vllm_model(t, config, reported["vllm"])
        vendor = next((g.vendor for g in config.gpus if g.index in t.gpu_ids), "")
        sleep = sleep_mode(
            "vllm", vendor if t.gpu_required else "", parallelism=t.parallelism
        ).kept
    else:
        raise LaunchFailed(
            f"engine {t.engine or '(none)'} needs a container runtime; this node runs the "
            f"process runtime, which starts {' and '.join(sorted(reported)) or 'no engine'} "
            "here (vLLM where the agent has HETEROFLOW_AGENT_VLLM_PYTHON)"
        )
    # the chat template its GGUF needs (issue 33), on the command line as the dry run
    # shows it (the launcher would apply the same rule itself)
    meta = gguf_meta_of(Path(model)) if t.engine == "llamacpp" else None
    args = (*t.engine_args, *chat_template_args(t.engine, t.engine_args, meta))
    try:  # the one recipe of a process launch, the dry run's too
        cmd = process_launch(
            TaskShape.of(t, ports=ports_from_dicts(t.ports), engine_args=args),
            model=str(model), port=host_port_for(t), node=node, sleep_mode=sleep,
        )
    except CommandError as exc:
        raise LaunchFailed(str(exc)) from exc
    host_ports = mapped_host_ports(ports_from_dicts(t.ports), chosen_only=True)
    log_path = log_dir / f"{t.id}.log"
    return LaunchSpec(t.id, cmd.args, task_env(t, cmd), host_ports, log_path, host)


def _model_file(t: TaskAssignment, config: NodeConfig) -> Path:
    try:
        return resolve_model_file(t.model_path, *model_prefixes(
            t.model_path, t.model_fetched, config.allowed_volume_prefixes,
            config.denied_volume_prefixes,
        ))
    except ModelPathError as exc:
        raise LaunchFailed(str(exc)) from exc


def _vllm_model(t: TaskAssignment, config: NodeConfig, build: str) -> Path:
    if build == CPU_BUILD and t.gpu_required:
        raise LaunchFailed(
            f"this node's vLLM is its CPU build, which drives no card; the task asks for "
            f"{t.gpu_required} GPU(s)"
        )
    try:
        allowed, denied = model_prefixes(
            t.model_path, t.model_fetched, config.allowed_volume_prefixes,
            config.denied_volume_prefixes,
        )
        return resolve_model_dir(t.model_path, allowed, denied, engine=t.engine)
    except ModelPathError as exc:
        raise LaunchFailed(str(exc)) from exc


class ProcessLauncher(DoorKeeper):
    """Engines as child processes on this host (no Docker): llama.cpp, and vLLM where
    the agent was given a Python with it (``vllm_python``)."""

    def __init__(
        self, runtime: ProcessRuntime, config: NodeConfig, *, cpu_threads: int, log_dir: Path,
        address: str = "127.0.0.1", engine_address: str = ENGINE_ADDRESS,
        vllm_python: str = "",
    ) -> None:
        super().__init__(address, engine_address)
        self.runtime = runtime
        self._process = runtime
        self.config = config
        self.cpu_threads = cpu_threads
        self.log_dir = log_dir
        self.vllm_python = vllm_python
        self._engines: dict[str, str] | None = None  # asked once (vLLM's build: a subprocess)
        self._logs = file_source(lambda task_id: log_dir / f"{task_id}.log")

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        spec = build_launch(
            t, self.config, cpu_threads=self.cpu_threads, log_dir=self.log_dir,
            host=self.engine_address, engines=self.engines(), vllm_python=self.vllm_python,
            address=self.address,
        )
        spec = replace(spec, env={**spec.env, "HOME": str(self.runtime.work_dir)})
        self.open_for(t)
        try:
            self._process.start(spec)
        except Exception:
            self.doors.close(t.id)
            raise
        return spec.argv

    def resume(self, t: TaskAssignment) -> tuple[str, ...]:
        """A process has no container to keep: a wake launches the same argv again."""
        return self.launch(t)

    def engines(self) -> dict[str, str]:
        if self._engines is None:
            self._engines = local_engines(self.vllm_python)
        return dict(self._engines)

    def observe(self, inv: NodeInventory) -> None:
        pass  # a child process gets CUDA_VISIBLE_DEVICES; nothing else depends on the cards

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return self._logs(task_id, since)

    def file_roots(self, t: TaskAssignment) -> list[str]:
        return process_roots(
            t.model_path, self.config.allowed_volume_prefixes, self.config.denied_volume_prefixes
        )
