"""Turns a task assignment into what the process runtime starts.

Under the process runtime ``image`` is recorded but the engine's local launcher runs:
llama.cpp through ``heteroflow.engines.llamacpp_server``, with the argv built by the
same command builder as containers (``core.engines.commands``), listening on the node's
address (``HETEROFLOW_AGENT_ADDRESS``: 127.0.0.1 on one machine; the address the gateways
reach on several, as a container's published port would be) on the allocated host port
that stands for the container port. Engines that exist only
as container images (vLLM, SGLang, ...) need the Docker runtime and fail here with that
reason rather than pretending.

The process runtime is the trusted single-operator mode: it runs only the platform's own
engine launcher, never a task's ``command`` (that would be a user's program on the host,
as the agent's user) — the scheduler does not place such work here, and this is the
node's own refusal for anything that got past it. The engine starts from a clean
environment (``PROCESS_BASE_ENV``, never the agent's own, which may hold secrets) plus
the task's variables under the C3 rules and the deny-list.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.engine_door import DoorKeeper
from heteroflow.agent.file_requests import process_roots
from heteroflow.agent.inventory import NodeInventory
from heteroflow.agent.log_shipper import file_source
from heteroflow.agent.models import ModelPathError, resolve_model_file
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchFailed, LaunchSpec, Runtime
from heteroflow.core.containers import AGENT_OWNED_ENV, PROCESS_BASE_ENV, container_env
from heteroflow.core.engine_access import ENGINE_ADDRESS, key_env
from heteroflow.core.engines import LLAMACPP_AGENT_FLAGS, owned_flag_in
from heteroflow.core.engines.commands import CommandError, LaunchShape, process_argv
from heteroflow.core.ports import host_ports as mapped_host_ports
from heteroflow.core.ports import ports_from_dicts
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


def task_env(t: TaskAssignment) -> dict[str, str]:
    """The whole environment of an engine process: a clean base, the C3 rules, and the
    CUDA visibility a process (not a container) needs."""
    env = dict(PROCESS_BASE_ENV)
    env |= container_env(
        t.env,
        task_id=t.id,
        group_id=t.group_id,
        task_name=t.name,
        engine=t.engine,
        engine_env={},
        gpu=None,
    )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in t.gpu_ids)
    return env | key_env("llamacpp", t.engine_key)  # the launcher reads it (C14)


def host_port_for(t: TaskAssignment, container_port: int | None = None) -> int:
    """The host port standing for a container port (the first mapping by default)."""
    for p in ports_from_dicts(t.ports):
        if container_port is None or p.container_port == container_port:
            return p.host_port
    raise LaunchFailed(f"task has no mapping for container port {container_port}")


def build_launch(
    t: TaskAssignment, config: NodeConfig, *, cpu_threads: int, log_dir: Path,
    host: str = ENGINE_ADDRESS,
) -> LaunchSpec:
    env = task_env(t)
    host_ports = mapped_host_ports(ports_from_dicts(t.ports), chosen_only=True)
    port = host_port_for(t)
    log_path = log_dir / f"{t.id}.log"
    if t.command:
        raise LaunchFailed(
            "this node runs the process runtime, which never runs a custom task.command "
            "(it would run on the host): use a node with the Docker runtime"
        )
    if t.engine != "llamacpp":
        raise LaunchFailed(
            f"engine {t.engine or '(none)'} needs a container runtime; this node runs the "
            "process runtime, which can start llama.cpp only"
        )
    clash = owned_flag_in(t.engine_args, LLAMACPP_AGENT_FLAGS)
    if clash:
        raise LaunchFailed(f"engine_args may not set {clash}: the agent sets it")
    try:
        model = resolve_model_file(
            t.model_path, config.allowed_volume_prefixes, config.denied_volume_prefixes
        )
    except ModelPathError as exc:
        raise LaunchFailed(str(exc)) from exc
    extra = list(t.engine_args)
    if cpu_threads and not {"-t", "--threads"} & set(extra):
        extra += ["-t", str(cpu_threads)]
    shape = LaunchShape(
        engine="llamacpp",
        model_path=str(model),
        served_model_name=t.model_name,
        port=port,
        host=host,  # no container network: the node's private loopback, behind the door
        gpus=t.gpu_required,
        extra_args=tuple(extra),
    )
    try:
        argv = process_argv(shape, sys.executable)
    except CommandError as exc:
        raise LaunchFailed(str(exc)) from exc
    return LaunchSpec(t.id, tuple(argv), env, host_ports, log_path, host)


class ProcessLauncher(DoorKeeper):
    """Engines as child processes on this host (no Docker): llama.cpp only."""

    def __init__(
        self, runtime: ProcessRuntime, config: NodeConfig, *, cpu_threads: int, log_dir: Path,
        address: str = "127.0.0.1", engine_address: str = ENGINE_ADDRESS,
    ) -> None:
        super().__init__(address, engine_address)
        self.runtime = runtime
        self._process = runtime
        self.config = config
        self.cpu_threads = cpu_threads
        self.log_dir = log_dir
        self._logs = file_source(lambda task_id: log_dir / f"{task_id}.log")

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        spec = build_launch(
            t, self.config, cpu_threads=self.cpu_threads, log_dir=self.log_dir,
            host=self.engine_address,
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
        return {"llamacpp": ""} if importlib.util.find_spec("xllamacpp") is not None else {}

    def observe(self, inv: NodeInventory) -> None:
        pass  # a child process gets CUDA_VISIBLE_DEVICES; nothing else depends on the cards

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return self._logs(task_id, since)

    def file_roots(self, t: TaskAssignment) -> list[str]:
        return process_roots(
            t.model_path, self.config.allowed_volume_prefixes, self.config.denied_volume_prefixes
        )
