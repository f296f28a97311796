"""LoRA adapters served beside a base model, each under its own model name: pure rules.

A service whose engine loads adapters at runtime (the registry's ``runtime_lora``: vLLM)
may be created with ``max_loras`` > 0 — how many adapters its engine holds at once
(``--max-loras``; ``MAX_LORAS`` at most). Its adapters are a list of ``{name, path}`` on
the group (``task_groups.lora_adapters``), at most ``max_loras`` of them: the name is a
model name of the tenant like any other (a model route of the group, so the group's key
may call it), the path a host directory under the node's volume allow-list — the same
rule as a model path (``core.paths``), so create, the adapter API and the agent refuse
alike.

The agent loads them into each running engine at runtime (vLLM's
``POST /v1/load_lora_adapter``, which the engine takes only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), and unloads what the list no longer holds:
``plan_sync`` says what to do from what is wanted and what is loaded, ``retry_delay_s``
how long a failed load waits before the next try (doubling, capped): never a restart,
never a crash loop. A container sees the adapter where a task volume mounts it
(``engine_path``); the process runtime reads the host path itself.

On vLLM's CPU build every slot used makes base-model requests answer with the last
adapter loaded (seen with 0.32): keep ``max_loras`` above the number of adapters there.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from heteroflow.core.containers import DATA_MODELS
from heteroflow.core.paths import (
    VolumeRule,
    inside,
    model_path_problem,
    normalize,
    volume_refusal,
)

__all__ = [
    "ENABLE_ENV",
    "LOAD_PATH",
    "MAX_LORAS",
    "UNLOAD_PATH",
    "Adapter",
    "SyncPlan",
    "adapter_path_refusal",
    "adapters_of",
    "engine_path",
    "host_path",
    "lora_args",
    "lora_refusal",
    "plan_sync",
    "retry_delay_s",
]

MAX_LORAS = 8  # adapters one engine holds at once: each slot reserves memory up front
# vLLM's runtime routes answer only with this variable set (else 404)
ENABLE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter: the model name it is served under, the host path of its folder."""

    name: str
    path: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path}


def adapters_of(rows: Iterable[object]) -> tuple[Adapter, ...]:
    """Adapters from stored or wire values (dicts, or objects with ``name`` and ``path``);
    anything else is skipped."""
    out: list[Adapter] = []
    for r in rows:
        name = r.get("name") if isinstance(r, Mapping) else getattr(r, "name", None)
        path = r.get("path") if isinstance(r, Mapping) else getattr(r, "path", None)
        if isinstance(name, str) and isinstance(path, str) and name and path:
            out.append(Adapter(name, path))
    return tuple(out)


def lora_refusal(
    max_loras: int, *, engine: str, runtime_lora: bool, task_type: str, command: bool
) -> str | None:
    """Why a task may not have ``max_loras`` (None: it may). ``runtime_lora``: the
    registry says ``engine`` loads adapters at runtime."""
    if not max_loras:
        return None
    if max_loras < 0 or max_loras > MAX_LORAS:
        return f"max_loras must be between 0 (off) and {MAX_LORAS}"
    if task_type != "inference":
        return f"max_loras is for inference services, not {task_type}"
    if command:
        return "max_loras: a custom command sets its own engine flags"
    if not runtime_lora:
        return (
            "max_loras: only an engine that loads LoRA adapters at runtime (vllm) takes "
            f"them; the engine is {engine or 'not resolved (name it: task.engine)'}"
        )
    return None


def lora_args(max_loras: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """The engine flags and environment of a vLLM task with ``max_loras`` (none for 0).
    The adapter rank stays vLLM's default limit (16); a task needing more passes
    ``--max-lora-rank`` in its ``engine_args``."""
    if max_loras <= 0:
        return (), {}
    return ("--enable-lora", "--max-loras", str(max_loras)), dict(ENABLE_ENV)


def adapter_path_refusal(
    path: str, rules: Sequence[VolumeRule], scope: str, name: str = "path"
) -> str | None:
    """Why an adapter's ``path`` is refused without the node's files (None: only the
    node can tell): the model path's rule (``core.paths``) — its form, and an absolute
    path under an allowed volume prefix; a relative name lies under the node's model
    directory, as a model's does."""
    if not path:
        return f"{name} is empty: give the adapter's folder"
    problem = model_path_problem(path, name)
    if problem:
        return problem
    if path.startswith("/"):
        return volume_refusal(path, rules, scope, name=name)
    return None


def host_path(path: str) -> str:
    """The host path of an adapter: absolute as given, a relative name under the node's
    model directory (as ``model_path``)."""
    if path.startswith("/"):
        return normalize(path)
    return normalize(f"{DATA_MODELS}/{path.strip('/')}")


def engine_path(path: str, runtime: str, mounts: Iterable[tuple[str, str]]) -> str | None:
    """Where the engine reads the adapter at host ``path``: the path itself for the
    process runtime; in a container, under the task volume (``mounts``: host path,
    container path) that holds it — the deepest one —, None when none does: the adapter
    cannot be loaded there."""
    host = host_path(path)
    if runtime == "process":
        return host
    best: tuple[str, str] | None = None
    for src, target in mounts:
        src = normalize(src)
        if inside(host, [src]) and (best is None or len(src) > len(best[0])):
            best = (src, target)
    if best is None:
        return None
    rest = posixpath.relpath(host, best[0])
    return best[1] if rest == "." else posixpath.join(best[1], rest)


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """What the agent does to one engine: unload these names, then load these."""

    unload: tuple[str, ...] = ()
    load: tuple[Adapter, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.unload or self.load)


def plan_sync(wanted: Sequence[Adapter], loaded: Mapping[str, str]) -> SyncPlan:
    """From the adapters the server lists and those loaded (name -> path): unload what is
    no longer listed or moved to another path, load what is listed and not loaded (a
    moved one is unloaded first, then loaded from its new path)."""
    want = {a.name: a for a in wanted}
    unload = tuple(n for n, p in loaded.items() if n not in want or want[n].path != p)
    gone = set(unload)
    load = tuple(a for a in wanted if a.name not in loaded or a.name in gone)
    return SyncPlan(unload, load)


def retry_delay_s(failures: int, base_s: float, cap_s: float) -> float:
    """The wait before the next try after ``failures`` failed loads in a row: ``base_s``
    doubled each time, at most ``cap_s``."""
    if failures <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2 ** min(failures - 1, 30)))
