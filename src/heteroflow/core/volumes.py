"""A task's own bind mounts (FEATURES A2): what they are and every rule on them, pure.

A volume is ``{host_path, container_path, read_only}``. The host side follows the model
path's rule, the one in ``core.paths`` (its form, ``model_path_problem``; the node's
allow-list, ``volume_refusal``), with one difference: it must be absolute (a volume names
a host directory, not a model the node looks up). Read-only unless ``read_only`` is
false, as the model mount is always.

The container side must be an absolute, normalised path that shadows nothing the
platform mounts or the image needs:

* the model mount (``core.containers.model_mount``'s target) and the engine config
  files (``/heteroflow``): the same path, one inside the other, or one holding it — a
  bind over the model hides it, a bind inside a read-only model mount cannot even be
  created;
* the system paths of :data:`SYSTEM_PATHS` and anything below them (the kernel's
  ``/proc``, ``/sys``, ``/dev``; the image's programs and libraries ``/bin``, ``/sbin``,
  ``/lib*``, ``/usr``, ``/etc``; ``/boot``, ``/run``, ``/var/run``, and ``/`` itself):
  a bind there replaces what the engine runs on (``/etc/passwd``, ``/usr/lib/python3``)
  or what the runtime owns. ``/tmp``, ``/home``, ``/root``, ``/opt``, ``/mnt``, ``/srv``,
  ``/data`` (outside the model) and ``/var/...`` other than ``/var/run`` stay open: hub
  caches and LoRA folders live there;
* another volume of the same task at the same path.

Who asks: create and dry run (``services.placement.planning.check_task``) with the rules
of the nodes the caller may use, 400 naming ``task.volumes[i].<field>``; the agent before
it launches, with its own rule, then on the real paths (symlinks, existence:
``agent.container_launch``); the scheduler's node gate holds each host path to the
node's rule (``core.placement.filters``: ``host_volume``). The process runtime mounts
nothing: a task with volumes is refused at create when every node the caller may use
runs it, is never placed on such a node (``no_mounts``, a pending reason naming it), and
its launcher refuses one that got there anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from heteroflow.core.containers import Mount, model_mount
from heteroflow.core.paths import (
    VolumeRule,
    inside,
    model_path_problem,
    normalize,
    volume_refusal,
)

MAX_VOLUMES = 32
# The folder the agent's engine config files are mounted under (MindIE's config.json).
PLATFORM_DIR = "/heteroflow"
SYSTEM_PATHS = (
    "/proc", "/sys", "/dev", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    "/usr", "/boot", "/run", "/var/run",
)


@dataclass(frozen=True, slots=True)
class Volume:
    host_path: str
    container_path: str
    read_only: bool = True

    @classmethod
    def of(cls, raw: Volume | Mapping[str, Any] | Any) -> Volume:
        """From a stored row's dict, a wire model (attributes) or a Volume."""
        if isinstance(raw, Volume):
            return raw
        if isinstance(raw, Mapping):
            return cls(str(raw["host_path"]), str(raw["container_path"]),
                       bool(raw.get("read_only", True)))
        return cls(str(raw.host_path), str(raw.container_path), bool(raw.read_only))

    def to_json(self) -> dict[str, Any]:
        return {"host_path": self.host_path, "container_path": self.container_path,
                "read_only": self.read_only}

    def mount(self) -> Mount:
        return Mount(normalize(self.host_path), normalize(self.container_path), self.read_only)


def volumes_of(raw: Iterable[Volume | Mapping[str, Any] | Any]) -> tuple[Volume, ...]:
    return tuple(Volume.of(v) for v in raw)


def _overlap(a: str, b: str) -> bool:
    """One path is the other or lies inside it (either way round)."""
    return inside(a, [b]) or inside(b, [a])


def container_path_problem(path: str, name: str, reserved: Sequence[str]) -> str | None:
    """Why a volume's ``container_path`` is refused, or None. ``reserved``: the container
    paths the platform mounts for this task (its model, its config files)."""
    problem = model_path_problem(path, name)
    if problem:
        return problem
    if not path.startswith("/"):
        return f"{name} must be an absolute path in the container"
    norm = normalize(path)
    if norm == "/":
        return f"{name} may not be '/': it would replace the whole image"
    if inside(norm, SYSTEM_PATHS):
        return (
            f"{name} {path!r} would shadow a system path of the image or the runtime "
            f"({', '.join(SYSTEM_PATHS)}); mount it elsewhere, e.g. under /mnt or /data"
        )
    for target in reserved:
        if _overlap(norm, target):
            return (
                f"{name} {path!r} overlaps {target!r}, which the platform mounts for this "
                "task (its model or its engine config); choose another path"
            )
    return None


def host_path_problem(path: str, name: str, rules: Sequence[VolumeRule], scope: str) -> str | None:
    """Why a volume's ``host_path`` is refused: the model path's form and allow-list
    rule (``core.paths``), and it must be absolute."""
    problem = model_path_problem(path, name)
    if problem:
        return problem
    if not path.startswith("/"):
        return f"{name} must be an absolute path on the node"
    return volume_refusal(path, rules, scope, name)


def reserved_targets(model_path: str, engine: str) -> tuple[str, ...]:
    """The container paths the platform mounts for a task: its model and config files."""
    mount, inside_image = model_mount(model_path, engine)
    if mount is not None:
        return normalize(mount.target), PLATFORM_DIR
    if inside_image.startswith("/"):  # TensorRT-LLM's engine directory in its image
        return normalize(inside_image), PLATFORM_DIR
    return (PLATFORM_DIR,)


def volumes_refusal(
    volumes: Sequence[Volume],
    *,
    model_path: str,
    engine: str,
    rules: Sequence[VolumeRule],
    scope: str = "of every node you may use",
    prefix: str = "task.volumes",
) -> tuple[str, str] | None:
    """(why, field) for the first volume refused, or None: every rule of the module
    docstring that needs none of the node's files. One function for create, dry run and
    the agent, as ``model_path_refusal`` is for the model."""
    if len(volumes) > MAX_VOLUMES:
        return f"at most {MAX_VOLUMES} volumes", prefix
    reserved = reserved_targets(model_path, engine)
    seen: dict[str, int] = {}
    for i, v in enumerate(volumes):
        at = f"{prefix}[{i}]"
        problem = host_path_problem(v.host_path, f"{at}.host_path", rules, scope)
        if problem:
            return problem, f"{at}.host_path"
        name = f"{at}.container_path"
        problem = container_path_problem(v.container_path, name, reserved)
        if problem:
            return problem, name
        target = normalize(v.container_path)
        if target in seen:
            return (f"{name} {v.container_path!r} is also volume {seen[target]}'s path", name)
        seen[target] = i
    return None

