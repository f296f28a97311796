"""Paths a file request may name (FEATURES C7) and where a model may live (C4): pure
checks shared by server and agent.

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

A model path (``volume_allows``): an absolute one must lie inside one of the node's
allowed volume prefixes and inside none of its denied ones. The server checks it at
create against the prefixes the nodes report, before any file is read; the agent checks
it again on the real path before it opens anything.
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


def model_path_problem(path: str) -> str | None:
    """Why a task's ``model_path`` is refused by its form, or None (C4; issue 10).

    Absolute or relative (a name under /data/models on the node), it may hold no NUL
    and no ``..`` segment: a path that climbs out of a prefix is refused, not resolved.
    """
    if "\x00" in path:
        return "model_path may not contain a NUL character"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"model_path is longer than {MAX_PATH_BYTES} bytes"
    if ".." in path.split("/"):
        return "model_path may not contain a '..' segment"
    return None


def volume_allows(path: str, allowed: Iterable[str], denied: Iterable[str] = ()) -> bool:
    """The node's volume rule (C4), one definition for the server and the agent: an
    absolute ``path`` must be inside one of ``allowed`` and inside none of ``denied``,
    compared on normalised paths at segment boundaries ("/models" allows
    "/models/a.gguf", not "/models-evil/a"). Pure and lexical: the agent passes
    ``realpath`` results so that symlinks cannot lead out; callers refuse ``..`` first
    (``model_path_problem``)."""
    if not path.startswith("/"):
        return False
    return inside(path, allowed) and not inside(path, denied)


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
