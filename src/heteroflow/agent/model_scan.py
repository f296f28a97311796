"""Which models sit on this node's disks (FEATURES C10): scan roots, formats, incremental scans.

Owns three things:

* ``scan_dirs``: the scan roots. Agent config ``model_scan_dirs`` > env
  ``HETEROFLOW_MODEL_SCAN_DIRS`` (``os.pathsep``-separated) > the default cache dir
  (``~/.cache/huggingface``; ``HF_HOME`` is not consulted). The first source that is set
  REPLACES the others -- an empty config list counts as set (only /data/models is then
  scanned), an empty env value does not. ``ALWAYS_SCANNED`` (/data/models) is always
  appended; each root's ``hub``, ``models/hub`` and ``models`` subdirs are added when they
  exist; duplicates drop out, first place kept.
* What a model is. HuggingFace: a directory holding config.json, tokenizer_config.json and
  at least one weight file (*.safetensors / *.bin / *.pt / *.pth, training artifacts such
  as training_args.bin or optimizer.pt ignored); the hub cache layout
  ``models--org--name/snapshots/<rev>/`` counts as one model "org/name" (the revision of
  refs/main, else the newest snapshot). GGUF: *.gguf files; ``x-00001-of-00003.gguf``
  shards form ONE model (size summed, path = first shard; groups with a missing shard are
  still downloading and skipped). Decision: ``mmproj*.gguf`` (multimodal projectors) are
  never models of their own; they are attached to every GGUF model of the same directory
  -- listed after its shards in ``files`` and counted in ``size_bytes``, since the engine
  loads them alongside. ``path`` is authoritative; ``name`` is the path relative to its
  root (GGUF: without ``.gguf``/shard suffix; a directory holding exactly one GGUF model
  is named after the directory).
* ``ModelScanner``: full scans and mtime-driven incremental scans. Directories are walked at
  most ``MAX_DEPTH`` levels below a root, hidden ones skipped, HF model dirs not descended.
  Symlinked directories are never descended (no cycles, no escapes); symlinked files count
  only when their target resolves inside the root (the hub cache's snapshot -> blobs links
  do). Unreadable directories are skipped with a debug log. An incremental scan stats every
  known directory but re-lists only those whose mtime changed; a file growing in place does
  not change its directory's mtime, so sizes can lag until the next change or full scan.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from heteroflow.core.containers import DATA_MODELS

logger = logging.getLogger(__name__)

ENV_VAR = "HETEROFLOW_MODEL_SCAN_DIRS"
ALWAYS_SCANNED = Path(DATA_MODELS)  # one definition: core.containers
SUBDIRS = ("hub", "models/hub", "models")
MAX_DEPTH = 3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TRAINING_ARTIFACTS = re.compile(
    r"^(training_args|optimizer|scheduler|scaler|rng_state.*|trainer_state)\.(bin|pt|pth)$"
)
_SHARD = re.compile(r"^(?P<base>.+)-(?P<idx>\d{5})-of-(?P<total>\d{5})\.gguf$")


def default_cache_dir() -> Path:
    """``~/.cache/huggingface``: the default scan root when neither config nor env name any."""
    return Path.home() / ".cache" / "huggingface"


def scan_dirs(
    config_dirs: Sequence[str] | None, env: Mapping[str, str], default_cache_dir: Path
) -> list[Path]:
    """The scan roots, in order (see the module docstring for precedence and extras)."""
    if config_dirs is not None:
        bases = [Path(os.path.expanduser(d)) for d in config_dirs if d]
    elif env.get(ENV_VAR, "").strip():
        bases = [Path(os.path.expanduser(d)) for d in env[ENV_VAR].split(os.pathsep) if d]
    else:
        bases = [default_cache_dir]
    roots: list[Path] = []
    for base in [*bases, ALWAYS_SCANNED]:
        for candidate in [base, *(base / sub for sub in SUBDIRS)]:
            norm = Path(os.path.normpath(os.path.abspath(candidate)))
            if (candidate is base or candidate.is_dir()) and norm not in roots:
                roots.append(norm)
    return roots


@dataclass(frozen=True)
class ScannedModel:
    """One model found on disk, as reported in the heartbeat."""

    name: str
    path: str
    format: Literal["hf", "gguf"]
    size_bytes: int
    files: tuple[str, ...]
    mtime: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``files`` as a list)."""
        d = asdict(self)
        d["files"] = list(self.files)
        return d


@dataclass
class _Node:
    """A directory's last listing: what it holds itself and where the walk goes next."""

    watched: tuple[Path, ...]
    fingerprint: tuple[float, ...]
    models: list[ScannedModel] = field(default_factory=list)
    children: list[tuple[Path, str]] = field(default_factory=list)  # (dir, model name)


def _fingerprint(paths: tuple[Path, ...]) -> tuple[float, ...] | None:
    try:
        return tuple(os.stat(p).st_mtime for p in paths)
    except OSError:
        return None


def _inside(path: str, root_real: str) -> bool:
    return path == root_real or path.startswith(root_real.rstrip(os.sep) + os.sep)


class ModelScanner:
    """Scans ``dirs`` for models; keeps per-directory mtimes for incremental scans."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = list(dirs)
        self._nodes: dict[Path, _Node] = {}

    def full(self) -> list[ScannedModel]:
        """Forget what was seen and list every root again."""
        self._nodes.clear()
        return self.incremental()

    def incremental(self) -> list[ScannedModel]:
        """Re-list only directories whose mtime changed; the full current list."""
        old, self._nodes = self._nodes, {}
        roots = set(self.dirs)
        found: dict[str, ScannedModel] = {}
        for root in self.dirs:
            root_real = os.path.realpath(root)
            stack: list[tuple[Path, str, int]] = [(root, "", 0)]
            while stack:
                directory, name, depth = stack.pop()
                node = self._visit(directory, name, root_real, roots, old.get(directory))
                if node is None:
                    continue
                self._nodes[directory] = node
                for model in node.models:
                    found.setdefault(model.path, model)
                if depth < MAX_DEPTH:
                    stack.extend((d, n, depth + 1) for d, n in reversed(node.children))
        return sorted(found.values(), key=lambda m: (m.name, m.path))

    def _visit(
        self, directory: Path, name: str, root_real: str, roots: set[Path], cached: _Node | None
    ) -> _Node | None:
        if cached is not None and _fingerprint(cached.watched) == cached.fingerprint:
            return cached
        try:
            return _list_dir(directory, name, root_real, roots)
        except OSError as exc:
            logger.debug("model scan: skipping %s: %s", directory, exc)
            return None


def _list_dir(directory: Path, name: str, root_real: str, roots: set[Path]) -> _Node | None:
    if directory.name.startswith("models--") and (directory / "snapshots").is_dir():
        return _hub_repo(directory, root_real)
    watched = (directory,)
    fingerprint = _fingerprint(watched)
    if fingerprint is None:
        return None
    files: dict[str, os.stat_result] = {}
    subdirs: list[Path] = []
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                child = directory / entry.name
                if child not in roots and not entry.name.startswith(("datasets--", "spaces--")):
                    subdirs.append(child)
            elif entry.is_file() and _inside(os.path.realpath(entry.path), root_real):
                files[entry.name] = entry.stat()
    label = name or directory.name
    node = _Node(watched, fingerprint)
    is_hf = _is_hf(files)
    if is_hf:
        node.models.append(_hf_model(label, directory, files))
    node.models.extend(_gguf_models(name, directory, files, own_name=not is_hf))
    if not is_hf:
        prefix = f"{name}/" if name else ""
        node.children = [(d, prefix + d.name) for d in subdirs]
    return node


def _hub_repo(repo: Path, root_real: str) -> _Node | None:
    """``models--org--name``: the refs/main snapshot (else the newest) as model "org/name"."""
    name = "/".join(repo.name.split("--")[1:])
    snapshots = repo / "snapshots"
    revision = ""
    with contextlib.suppress(OSError):
        revision = (repo / "refs" / "main").read_text().strip()
    candidates = [p for p in snapshots.iterdir() if p.is_dir() and not p.is_symlink()]
    by_name = {p.name: p for p in candidates}  # refs/main only ever names one of these
    chosen = by_name.get(revision)
    if chosen is None and candidates:
        chosen = max(candidates, key=lambda p: p.stat().st_mtime)
    watched = tuple(p for p in (repo, repo / "refs", snapshots, chosen) if p and p.exists())
    fingerprint = _fingerprint(watched)
    if fingerprint is None:
        return None
    if chosen is None:
        return _Node(watched, fingerprint)
    inner = _list_dir(chosen, name, root_real, set())
    if inner is None:
        return None
    return _Node(watched, fingerprint, inner.models, inner.children)


def _is_weight(filename: str) -> bool:
    return filename.endswith(WEIGHT_SUFFIXES) and not TRAINING_ARTIFACTS.match(filename)


def _is_hf(files: Mapping[str, os.stat_result]) -> bool:
    return (
        "config.json" in files
        and "tokenizer_config.json" in files
        and any(_is_weight(f) for f in files)
    )


def _hf_model(name: str, directory: Path, files: Mapping[str, os.stat_result]) -> ScannedModel:
    kept = sorted(f for f in files if not TRAINING_ARTIFACTS.match(f))
    return ScannedModel(
        name=name, path=str(directory), format="hf",
        size_bytes=sum(files[f].st_size for f in kept), files=tuple(kept),
        mtime=max(files[f].st_mtime for f in kept),
    )


def _gguf_models(
    name: str, directory: Path, files: Mapping[str, os.stat_result], *, own_name: bool
) -> list[ScannedModel]:
    """The GGUF models among ``files``: shards grouped, incomplete groups skipped."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    mmproj = [f for f in ggufs if f.lower().startswith("mmproj")]
    groups: dict[tuple[str, int], list[str]] = {}  # (base, shard total or 0) -> files
    for filename in ggufs:
        shard = _SHARD.match(filename)
        if filename in mmproj:
            continue
        if shard is None:
            groups[(filename[: -len(".gguf")], 0)] = [filename]
        else:
            key = (shard.group("base"), int(shard.group("total")))
            groups.setdefault(key, []).append(filename)
    models: list[ScannedModel] = []
    for (base, total), members in groups.items():
        if total and len(members) != total:
            logger.debug("model scan: %s/%s: %d of %d shards, skipped",
                         directory, base, len(members), total)
            continue
        first = directory / members[0]
        if not _gguf_header(first, files[members[0]]):
            # issue 33: an empty or foreign file is no model to offer ("Deploy" would fail)
            logger.debug("model scan: %s is not a GGUF file (empty or no GGUF magic)", first)
            continue
        if not name:
            label = base
        elif own_name and len(groups) == 1:
            label = name
        else:
            label = f"{name}/{base}"
        parts = (*members, *mmproj)
        models.append(ScannedModel(
            name=label, path=str(directory / members[0]), format="gguf",
            size_bytes=sum(files[f].st_size for f in parts), files=parts,
            mtime=max(files[f].st_mtime for f in parts),
        ))
    return models


def _gguf_header(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` starts like a GGUF file: at least its fixed header (24 bytes) and
    the magic. The rest of the header is the create's check (models.estimate)."""
    if st.st_size < 24:
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False

