"""Paths a file request may name (FEATURES C7): pure checks shared by server and agent.

A target must be an absolute POSIX path of at most 4096 bytes (UTF-8) without NUL and
without a ``..`` segment, and it must lie inside a host directory the task mounts.
"Inside" is decided on path-segment boundaries: ``/data/models2/x`` is not inside
``/data/models``. These checks are lexical; the agent, where the files are, repeats
them on ``realpath`` results so that a symlink cannot lead out of a root (the agent is
the security boundary; the server's check only refuses obvious mistakes early).

Which directories a task mounts (``task_roots``):
- containers: the sources of the task's mounts (today the model mount, ``core.containers``);
- the process runtime: the folder of the task's model file (``dirname(model_path)``); a
  relative model name is looked for under ``/data/models`` by the server, while the
  agent uses the folder of the file it actually resolved.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from heteroflow.core.containers import DATA_MODELS, model_mount

MAX_PATH_BYTES = 4096


def normalize(path: str) -> str:
    """Lexically normalized absolute path (``//x`` and ``/x/`` become ``/x``)."""
    norm = posixpath.normpath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    return norm


def validate_target(path: str) -> str | None:
    """Why ``path`` cannot be a file request target, or None when its form is fine."""
    if not path:
        return "target_path is empty"
    if "\x00" in path:
        return "target_path may not contain a NUL character"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"target_path is longer than {MAX_PATH_BYTES} bytes"
    if not path.startswith("/"):
        return "target_path must be an absolute path"
    if ".." in path.split("/"):
        return "target_path may not contain a '..' segment"
    return None


def inside(path: str, roots: Iterable[str]) -> bool:
    """Whether ``path`` is one of ``roots`` or below one, on segment boundaries."""
    p = normalize(path)
    for root in roots:
        if not root or not root.startswith("/"):
            continue
        r = normalize(root)
        if p == r or p.startswith(r if r == "/" else r + "/"):
            return True
    return False


def task_roots(model_path: str, engine: str, runtime: str) -> list[str]:
    """The host directories a task mounts, as the server can tell from its record."""
    if not model_path:
        return []
    if runtime == "process":
        if model_path.startswith("/"):
            file = normalize(model_path)
        else:
            file = normalize(f"{DATA_MODELS}/{model_path.strip('/')}")
        return [posixpath.dirname(file) or "/"]
    mount, _ = model_mount(model_path, engine)
    return [] if mount is None else [normalize(mount.source)]
