"""Paths a file request may name (FEATURES C7) and where a model may live (C4): pure
checks shared by server and agent.

A target must be an absolute POSIX path of at most 4096 bytes (UTF-8) without NUL and
without a ``..`` segment, and it must lie inside a host directory the task mounts.
"Inside" is decided on path-segment boundaries: ``/data/models2/x`` is not inside
``/data/models``. These checks are lexical; the agent, where the files are, repeats
them on ``realpath`` results so that a symlink cannot lead out of a root (the agent is
the security boundary; the server's check only refuses obvious mistakes early).

Which directories a task mounts (``task_roots``):
- containers: the sources of the task's mounts (the model mount, ``core.containers``, and
  the task's volumes, ``core.volumes``);
- the process runtime: the folder of the task's model file (``dirname(model_path)``); a
  relative model name is looked for under ``/data/models`` by the server, while the
  agent uses the folder of the file it actually resolved.

A model path: ``model_path_refusal`` is every refusal that needs none of the node's
files — its form, the engine's rules and the volume rule (``volume_allows``: an absolute
path inside one of the node's allowed volume prefixes, inside none of its denied ones).
Create and dry run call it with the rules of the nodes the caller may use, before any
file is read or anything written; the agent calls it with its own rule before it looks
at the disk, then checks what needs the files (symlinks on ``realpath``, existence, the
GGUF inside a folder). One function, so the two cannot disagree (issue 26).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from heteroflow.core.containers import DATA_MODELS, MODEL_IN_IMAGE, model_mount
from heteroflow.core.errors import ValidationFailed

MAX_PATH_BYTES = 4096
MAX_SEGMENT_BYTES = 255  # NAME_MAX: a longer name is an OS error on every Linux filesystem
MAX_PREFIXES_SHOWN = 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# weights llama.cpp cannot load (it reads one GGUF file, or the folder it is in)
NOT_GGUF = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".h5", ".msgpack",
            ".json")
GGUF_ONLY = frozenset({"llamacpp"})


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


def model_path_problem(path: str, name: str = "model_path") -> str | None:
    """Why a ``model_path`` is refused by its form alone, or None (C4; issues 10, 26).

    Absolute or relative (a name the node looks up in its model directories): no NUL or
    other control character, no ``..`` segment (a path that climbs out of a prefix is
    refused, not resolved), at most 4096 bytes with no name over 255 (the node's
    filesystem would answer an OS error), no whitespace at either end, no URL (the node
    reads files; it downloads nothing), no ``~`` (nothing expands it), and a relative
    name must name something inside the model directory, not the directory itself.
    ``name``: the field the messages name (a volume's host path follows the same rule,
    ``core.volumes``).
    """
    if "\x00" in path:
        return f"{name} may not contain a NUL character"
    control = _CONTROL.search(path)
    if control:
        return f"{name} may not contain a control character (U+{ord(control[0]):04X})"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"{name} is longer than {MAX_PATH_BYTES} bytes"
    segments = path.split("/")
    if ".." in segments:
        return f"{name} may not contain a '..' segment"
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES for p in segments):
        return f"{name} has a name longer than {MAX_SEGMENT_BYTES} bytes"
    if path != path.strip():
        return f"{name} may not start or end with whitespace"
    if _URL.match(path):
        return (
            f"{name} is a URL; the node reads model files, it downloads nothing: put "
            "the model in a model directory and name its path"
        )
    if path.startswith("~"):
        return f"{name} may not start with '~' (nothing expands it): give an absolute path"
    if path and not path.startswith("/") and posixpath.normpath(path) == ".":
        return f"{name} names the model directory itself: name a model file or folder in it"
    return None


@dataclass(frozen=True, slots=True)
class VolumeRule:
    """One node's C4 volume rule, as its agent reports it in the heartbeat."""

    allowed: tuple[str, ...]
    denied: tuple[str, ...] = ()


def on_host(path: str, engine: str) -> bool:
    """Whether ``path`` is a host path the volume rule governs: absolute, for an engine
    whose model is not inside its image. Create, the agent and the scheduler's node gate
    (a node whose rule refuses it is never chosen) ask it alike."""
    return path.startswith("/") and engine not in MODEL_IN_IMAGE


def volume_refusal(
    path: str, rules: Sequence[VolumeRule], scope: str, name: str = "model_path"
) -> str | None:
    """Why the volume rules of ``rules`` refuse the absolute host ``path`` (None: one of
    them allows it), in words naming the field ``name`` and the prefixes on offer. One
    rule for a model path and a volume's host path (``core.volumes``)."""
    if any(volume_allows(path, r.allowed, r.denied) for r in rules):
        return None
    if not rules:
        model = name == "model_path"
        return (
            f"{name} {path!r}: no node you may use has registered yet, so no node allows "
            f"an absolute {'model' if model else 'host'} path; start an agent with "
            "allowed_volume_prefixes" + (", or give a model name under /data/models" if model
                                         else "")
        )
    offered = sorted({normalize(p) for r in rules for p in r.allowed if p.startswith("/")})
    denied = sorted({normalize(p) for r in rules for p in r.denied if p.startswith("/")})
    if any(inside(path, r.allowed) for r in rules):
        shown = ", ".join(denied[:MAX_PREFIXES_SHOWN])
        return f"{name} {path!r} is under a denied volume prefix {scope}: {shown}"
    shown = ", ".join(offered[:MAX_PREFIXES_SHOWN]) or "none"
    if len(offered) > MAX_PREFIXES_SHOWN:
        shown += f" and {len(offered) - MAX_PREFIXES_SHOWN} more"
    except_ = f" (except under {', '.join(denied[:MAX_PREFIXES_SHOWN])})" if denied else ""
    return (
        f"{name} {path!r} is outside the allowed volume prefixes {scope}; "
        f"allowed: {shown}{except_}"
    )


def model_path_refusal(
    path: str,
    *,
    engine: str,
    custom_command: bool,
    rules: Sequence[VolumeRule],
    scope: str = "of every node you may use",
) -> str | None:
    """Why ``path`` cannot run, as far as it can be told without the node's files; None
    when only the node's files can tell (issue 26: one decision for create, dry run and
    the agent).

    ``engine``: the resolved engine ("" when a node's chain picks it later: its rules
    wait for the node); ``custom_command``: the task's own command starts it, so no
    engine rule applies; ``rules``: the volume rules of the nodes that may run it (the
    server: those the caller may use, offline ones too; the agent: its own), ``scope``
    says which in the message. An engine whose model lies in its image (TensorRT-LLM)
    needs an absolute path there, and no host rule applies to it.
    """
    if not path:
        if engine and not custom_command:
            return (
                f"no model_path: engine {engine} starts from a model; give task.model_path "
                "(or a custom task.command)"
            )
        return None
    if _URL.match(path):  # issue 29: a model source, fetched by the node (agent/fetching)
        return model_source_refusal(path, engine=engine, custom_command=custom_command)
    problem = model_path_problem(path)
    if problem:
        return problem
    if engine in MODEL_IN_IMAGE:
        if not path.startswith("/"):
            return (
                f"engine {engine} serves the engine directory inside its image: model_path "
                "must be its absolute path there"
            )
        return None
    if engine in GGUF_ONLY and not custom_command and path.lower().endswith(NOT_GGUF):
        return (
            f"engine {engine} loads GGUF models only; {posixpath.basename(path)!r} is not "
            "one: name a .gguf file (the first shard of a split model) or its folder"
        )
    if on_host(path, engine):
        return volume_refusal(path, rules, scope)
    return None


def model_source_refusal(path: str, *, engine: str, custom_command: bool) -> str | None:
    """Why a model source (``core.model_sources``) cannot run, or None. Its form is the
    parser's; an engine whose model lies in its image takes none; a GGUF-only engine
    (llama.cpp) takes the URL of one GGUF file or an archive, not a hub repository (which
    holds every quantisation of a model: the node would fetch them all) — a ``fleet://``
    copy of one included, which its key's kind tells (``hf--…``)."""
    from heteroflow.core.model_sources import SourceKind, parse_model_source

    try:
        source = parse_model_source(path)
    except ValidationFailed as exc:
        return str(exc)
    if engine in MODEL_IN_IMAGE:
        return f"engine {engine} serves the engine directory inside its image: no model source"
    if engine in GGUF_ONLY and not custom_command and source.kind is SourceKind.FLEET:
        if not source.location.startswith(f"{SourceKind.URL.value}--"):
            return (
                f"engine {engine} loads one GGUF file: {source.text} is a copy of a whole "
                "hub repository; name the copy of one GGUF file's URL"
            )
    elif engine in GGUF_ONLY and not custom_command and source.kind is not SourceKind.URL:
        return (
            f"engine {engine} loads one GGUF file: name its URL (e.g. https://huggingface.co/"
            "org/name/resolve/main/model-q4_k_m.gguf), not a whole hub repository"
        )
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


def task_roots(
    model_path: str, engine: str, runtime: str, volume_sources: Sequence[str] = ()
) -> list[str]:
    """The host directories a task mounts, as the server can tell from its record;
    ``volume_sources``: its volumes' host paths (a container mounts them; the process
    runtime mounts nothing)."""
    if runtime != "process":
        return [*_model_roots(model_path, engine), *(normalize(v) for v in volume_sources)]
    if not model_path:
        return []
    if model_path.startswith("/"):
        file = normalize(model_path)
    else:
        file = normalize(f"{DATA_MODELS}/{model_path.strip('/')}")
    return [posixpath.dirname(file) or "/"]


def _model_roots(model_path: str, engine: str) -> list[str]:
    """A container's model mount, by its host side."""
    if not model_path:
        return []
    mount, _ = model_mount(model_path, engine)
    return [] if mount is None else [normalize(mount.source)]
