"""Turns a task assignment into a container and starts it on the Docker runtime.

The container is the one recipe the dry run shows (``core.recipe.container_plan``):
the engine argv for the container port on all container interfaces, C3 environment,
the model mounted read-only, engine config files written under the work dir and
mounted read-only, GPU arguments for the node's vendor, shared memory / IPC / host
network per shape (C5), and ports published only on the node's address (127.0.0.1 on
a single node) — an engine's API port on the node's private loopback instead, behind
the node's door (C14: an open engine port would bypass the gateway's keys).

The model path is checked here, on the node (C4): an absolute path must sit inside
the allow-list before anything about it is probed; a relative name means
``/data/models/{name}`` (a HuggingFace folder with config.json, a GGUF file or a
folder of GGUF files). A missing model fails the task with that reason. So are the
task's volumes (A2): first the rule create and dry run applied (``core.volumes``, with
this node's allow-list), then each host path on its real path (a symlink cannot lead
out of the allow-list) and that it exists; mounted read-only unless asked otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.engine_door import DoorKeeper
from heteroflow.agent.engine_probe import VERSION_LABEL, kv_offload_check
from heteroflow.agent.inventory import GpuCard, NodeInventory
from heteroflow.agent.models import (
    DATA_MODELS,
    THIS_NODE,
    ModelPathError,
    check_allowed,
    model_prefixes,
)
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.containers import MODEL_IN_IMAGE, ContainerPlan
from heteroflow.core.engine_access import key_env
from heteroflow.core.engines.chat_templates import chat_template_args
from heteroflow.core.images import PullProgress
from heteroflow.core.paths import VolumeRule, model_path_refusal, task_roots
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.recipe import NodeShape, TaskShape, container_plan
from heteroflow.core.volumes import volumes_of, volumes_refusal
from heteroflow.logs import register_secrets
from heteroflow.models.estimate import gguf_meta_of
from heteroflow.private_files import private_dir, private_file
from heteroflow.schemas.nodes import TaskAssignment


def _check_model(t: TaskAssignment, config: NodeConfig) -> None:
    """C4 on the node: first the rule create and dry run applied (``model_path_refusal``,
    one function), then what needs this node's files."""
    rule = VolumeRule(*model_prefixes(
        t.model_path, t.model_fetched, config.allowed_volume_prefixes,
        config.denied_volume_prefixes,
    ))
    problem = model_path_refusal(
        t.model_path, engine=t.engine, custom_command=bool(t.command), rules=[rule],
        scope=THIS_NODE,
    )
    if problem:
        raise LaunchFailed(problem)
    if not t.model_path or t.engine in MODEL_IN_IMAGE:
        return  # TensorRT-LLM's engine directory lives in its image
    if os.path.isabs(t.model_path):
        try:
            real = check_allowed(Path(t.model_path), rule.allowed, rule.denied)
        except ModelPathError as exc:
            raise LaunchFailed(str(exc)) from exc
    else:
        real = DATA_MODELS / t.model_path.strip("/")
        ok = (real / "config.json").is_file() or real.is_file() or any(real.glob("*.gguf"))
        if not ok:
            raise LaunchFailed(
                f"model {t.model_path!r} not found: expected {real}/config.json, "
                f"a GGUF file or a folder of GGUF files under {DATA_MODELS}"
            )
        return
    if not real.exists():
        raise LaunchFailed(f"model path {t.model_path!r} does not exist on this node")


def _check_volumes(t: TaskAssignment, config: NodeConfig) -> None:
    """A2 on the node: the rule create applied, with this node's own allow-list, then the
    real host paths (symlinks resolved) inside it, and present."""
    if not t.volumes:
        return
    rule = VolumeRule(config.allowed_volume_prefixes, config.denied_volume_prefixes)
    volumes = volumes_of(t.volumes)
    refused = volumes_refusal(
        volumes, model_path=t.model_path, engine=t.engine, rules=[rule], scope=THIS_NODE
    )
    if refused:
        raise LaunchFailed(refused[0])
    for i, v in enumerate(volumes):
        what = f"task.volumes[{i}].host_path"
        try:
            real = check_allowed(Path(v.host_path), rule.allowed, rule.denied, what)
        except ModelPathError as exc:
            raise LaunchFailed(str(exc)) from exc
        if not real.exists():
            raise LaunchFailed(f"{what} {v.host_path!r} does not exist on this node")


def task_shape(t: TaskAssignment, engine_version: str = "") -> TaskShape:
    """The recipe's view of an assignment (the wire's port dicts become ``PortMapping``),
    with the chat template its GGUF needs (``core.engines.chat_templates``, read from
    the host's file, as the dry run reads it where the server can)."""
    meta = gguf_meta_of(Path(t.model_path)) if os.path.isabs(t.model_path) else None
    args = (*t.engine_args, *chat_template_args(t.engine, t.engine_args, meta))
    return TaskShape.of(
        t, ports=ports_from_dicts(t.ports), engine_version=engine_version, engine_args=args
    )


def build_container(
    t: TaskAssignment,
    config: NodeConfig,
    *,
    address: str,
    cards: Sequence[GpuCard],
    work_dir: Path,
    engine_version: str = "",
) -> ContainerPlan:
    """C4 and A2 on the node, then the one recipe (``core.recipe``); writes its config
    files."""
    _check_model(t, config)
    _check_volumes(t, config)
    node = NodeShape(address=address, card_vendors={c.index: c.vendor for c in cards})
    try:
        result = container_plan(
            task_shape(t, engine_version), node, work_dir_config=str(work_dir / "config")
        )
    except ValueError as exc:  # CommandError included
        raise LaunchFailed(str(exc)) from exc
    for f in result.config_files:
        host = Path(f.source)
        private_dir(host.parent)
        private_file(host).write_text(f.content)
    return result.plan


class DockerLauncher:
    """Starts task containers through a ``DockerRuntime``, each engine behind its door
    (C14: the API port published on the node's private loopback, the door on the node's
    address; the engine's key in its environment where it reads one).

    ``observe`` receives every heartbeat's inventory: the cards decide the GPU
    arguments, and the engine probe (``prober``) reruns on its schedule.
    """

    def __init__(
        self,
        runtime: Any,  # DockerRuntime (the docker SDK is imported only where it is used)
        config: NodeConfig,
        *,
        address: str,
        work_dir: Path,
        prober: Callable[[Sequence[GpuCard]], dict[str, str]] | None = None,
        probe_every: int = 20,
        version_of: Callable[[str], str | None] | None = None,
        pull_timeout_s: float = 1800.0,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.keeper = DoorKeeper(address)
        self._address = address
        self._work_dir = work_dir
        self._prober = prober
        self._probe_every = probe_every
        self._cards: tuple[GpuCard, ...] = ()
        self._engines: dict[str, str] = {}
        self._beats = 0
        self.log_tail = 2000
        self._version_of = version_of
        self.pull_timeout_s = pull_timeout_s  # H7: a pull ends within this
        self._memory = (0, 0)  # MemTotal, MemAvailable in MiB, from the last heartbeat
        self._offload: dict[str, int] = {}  # task id -> declared kv offload GiB

    def observe(self, inv: NodeInventory) -> None:
        self._cards = inv.gpus
        self._memory = (inv.memory_total_mb, inv.memory_available_mb)
        if self._prober is not None and self._beats % self._probe_every == 0:
            self._engines = self._prober(self._cards)  # at start and every N heartbeats (C9)
        self._beats += 1

    def prepare(self, t: TaskAssignment, progress: Callable[[PullProgress], None]) -> bool:
        """H7: the task's image present on this node — pulled when absent, one pull per
        image (``runtime.images``), with the login the server sent with the claim."""
        auth = t.registry_auth.model_dump() if t.registry_auth is not None else None
        if auth is not None:
            register_secrets(auth["password"])  # never in this agent's log lines
        pulled: bool = self.runtime.images.ensure(t.image, auth, self.pull_timeout_s, progress)
        return pulled

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        version = self._kv_offload_gate(t) if t.kv_offload_gb else ""
        plan = build_container(
            t,
            self.config,
            address=self._address,
            cards=self._cards,
            work_dir=self._work_dir,
            engine_version=version,
        )
        plan = replace(plan, env={**plan.env, **key_env(t.engine, t.engine_key)})
        self.keeper.open_for(t)
        try:
            self.runtime.start(plan)
        except Exception:
            self.keeper.doors.close(t.id)
            raise
        if t.kv_offload_gb:
            self._offload[t.id] = t.kv_offload_gb
        return (*(plan.entrypoint or ()), *plan.command)

    def resume(self, t: TaskAssignment) -> tuple[str, ...]:
        """C2's resume branch: the kept container starts again, exactly as created."""
        self.keeper.open_for(t)
        self.runtime.resume(t.id)
        return ()

    def probe_host_for(self, t: TaskAssignment, port: int) -> str:
        return self.keeper.probe_host_for(t, port)

    def keep_doors(self, tasks: list[TaskAssignment]) -> None:
        self.keeper.keep_doors(tasks)

    def close_doors(self) -> None:
        self.keeper.close_doors()

    def _kv_offload_gate(self, t: TaskAssignment) -> str:
        """C12 on the node: the image's vLLM version picks the flag form; red lines."""
        version = self._version_of(t.image) if self._version_of else None
        if not version:
            raise LaunchFailed(
                f"kv_offload_gb needs the vLLM version of {t.image}, which could not be read; "
                f"label the image {VERSION_LABEL}=<version> or use an image with vLLM"
            )
        running = self.runtime.managed()
        others = sum(
            gb for tid, gb in self._offload.items() if tid != t.id and running.get(tid) == "running"
        )
        total, available = self._memory
        reason = kv_offload_check(t.kv_offload_gb, others, total, available)
        if reason:
            raise LaunchFailed(reason)
        return version

    def engines(self) -> dict[str, str]:
        return dict(self._engines)

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        """Container logs since a timestamp (tail 2000 lines per round, C6)."""
        text, nxt = self.runtime.logs_since(
            task_id, float(since) if since else None, tail=self.log_tail
        )
        return str(text), repr(float(nxt))

    def file_roots(self, t: TaskAssignment) -> list[str]:
        volumes = [v.host_path for v in volumes_of(t.volumes)]
        return task_roots(t.model_path, t.engine, "docker", volumes)
