"""Where a task's model lives on this node (FEATURES C4, process-runtime form).

First the rule create and dry run applied (``core.paths.model_path_refusal``: the form,
the engine's, the volume rule on the path as written), then on the real path: absolute
paths must sit under one of the node's allowed volume prefixes and under none of its
denied ones — compared on path-segment boundaries after resolving symlinks — and
nothing outside the allow-list is even probed. A relative name is looked
up as ``{dir}/{name}`` or ``{dir}/{name}.gguf`` in the allowed dirs and /data/models.
A directory resolves to the GGUF inside it (the first shard of a split model).
"""

from __future__ import annotations

import os
from pathlib import Path

from heteroflow.core import containers
from heteroflow.core.paths import VolumeRule, inside, model_path_refusal

DATA_MODELS = Path(containers.DATA_MODELS)  # one definition: core.containers
THIS_NODE = "of this node"  # whose volume rule the agent's refusals name


class ModelPathError(Exception):
    pass


def check_allowed(
    path: Path, allowed: tuple[str, ...], denied: tuple[str, ...], what: str = "model path"
) -> Path:
    """The server's rule (``core.paths.volume_allows``) on real paths: symlinks and
    ``..`` are resolved on both sides before the segment-boundary comparison. ``what``
    names the path in the refusal (a volume's host path follows the same rule, A2)."""
    real = Path(os.path.realpath(path))
    if not inside(str(real), [os.path.realpath(p) for p in allowed]):
        raise ModelPathError(
            f"{what} {str(path)!r} is outside this node's allowed volume prefixes"
        )
    if inside(str(real), [os.path.realpath(p) for p in denied]):
        raise ModelPathError(f"{what} {str(path)!r} is under a denied volume prefix")
    return real


def model_prefixes(
    model_path: str, fetched: bool, allowed: tuple[str, ...], denied: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The allow- and deny-lists a task's model path is held to: the node's own, plus —
    for a model the agent fetched into its cache (issue 29) — exactly that entry, which a
    user could never name (the cache is not an allowed prefix: another tenant's download
    may lie there)."""
    return ((*allowed, model_path), denied) if fetched else (allowed, denied)


def _gguf_in(directory: Path) -> Path:
    ggufs = sorted(directory.glob("*.gguf"))
    if not ggufs:
        raise ModelPathError(f"no .gguf file in {str(directory)!r}")
    shards = [g for g in ggufs if "-00001-of-" in g.name]
    return shards[0] if shards else ggufs[0]


def resolve_model_file(
    model_path: str, allowed: tuple[str, ...], denied: tuple[str, ...]
) -> Path:
    """The model file the process runtime (llama.cpp only) starts from; ModelPathError
    with the reason the task fails with."""
    problem = model_path_refusal(
        model_path, engine="llamacpp", custom_command=False,
        rules=[VolumeRule(allowed, denied)], scope=THIS_NODE,
    )
    if problem:
        raise ModelPathError(problem)
    if os.path.isabs(model_path):  # the lexical rule held: now the real path (symlinks)
        real = check_allowed(Path(model_path), allowed, denied)
        if real.is_dir():
            return _gguf_in(real)
        if not real.is_file():
            raise ModelPathError(f"model path {model_path!r} does not exist on this node")
        return real
    for base in (*allowed, str(DATA_MODELS)):
        for candidate in (Path(base) / model_path, Path(base) / f"{model_path}.gguf"):
            if candidate.exists():
                real = check_allowed(candidate, (*allowed, str(DATA_MODELS)), denied)
                return _gguf_in(real) if real.is_dir() else real
    raise ModelPathError(f"model {model_path!r} not found in this node's model dirs")


def _hf_dir(path: Path, shown: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelPathError(f"model path {shown!r} is not a model directory (no config.json)")
    return path


def resolve_model_dir(
    model_path: str, allowed: tuple[str, ...], denied: tuple[str, ...], *, engine: str
) -> Path:
    """The model directory a Hugging Face engine on the process runtime (vLLM) serves: an
    allow-listed local directory with a ``config.json``, by absolute path or by name under
    the allowed dirs and /data/models — never a hub id fetched from the network."""
    problem = model_path_refusal(
        model_path, engine=engine, custom_command=False,
        rules=[VolumeRule(allowed, denied)], scope=THIS_NODE,
    )
    if problem:
        raise ModelPathError(problem)
    if os.path.isabs(model_path):
        real = check_allowed(Path(model_path), allowed, denied)
        if not real.exists():
            raise ModelPathError(f"model path {model_path!r} does not exist on this node")
        return _hf_dir(real, model_path)
    for base in (*allowed, str(DATA_MODELS)):
        candidate = Path(base) / model_path
        if candidate.is_dir():
            real = check_allowed(candidate, (*allowed, str(DATA_MODELS)), denied)
            return _hf_dir(real, model_path)
    raise ModelPathError(
        f"model {model_path!r} not found in this node's model dirs (the process runtime "
        "serves local directories only; it downloads nothing)"
    )
