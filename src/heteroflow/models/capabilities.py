"""The model-reading half of capabilities (issue 15 item 2): :class:`ModelFacts` from the
files at a model path, as far as this machine can see them.

* a ``.gguf`` file (or a split model's first shard): its header through
  :func:`heteroflow.models.estimate.read_gguf_meta` (milliseconds, the vocabulary skipped);
* a directory with ``config.json``: config.json, tokenizer_config.json and a separate
  ``chat_template.jinja`` when present;
* a directory of GGUF files: the one the launcher would load (``mmproj*`` skipped).

A relative path is a name under /data/models (the container runtime's convention). The
server reads what it can see: in the all-in-one deployment, or with models on shared
storage, that is every model; a model that lives only on a remote node's disk reads as
None (unknown), and its capabilities come from the engine and its flags alone.

Reads are cached per (path, size, mtime), so the snapshot loop that asks every second
costs one ``stat`` per model. Never raises: anything unreadable is None.
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from heteroflow.core.containers import DATA_MODELS
from heteroflow.core.engines.capabilities import ModelFacts, facts_from_gguf, facts_from_hf
from heteroflow.models.estimate import gguf_shards, read_gguf_meta

log = logging.getLogger(__name__)

_CACHE_SIZE = 1024


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _gguf_of(directory: Path) -> Path | None:
    ggufs = [
        p for p in sorted(directory.glob("*.gguf"))
        if p.is_file() and not p.name.lower().startswith("mmproj")
    ]  # fmt: skip
    shards = [p for p in ggufs if "-00001-of-" in p.name]
    return shards[0] if shards else (ggufs[0] if ggufs else None)


def _resolve(model_path: str) -> Path | None:
    path = Path(model_path)
    if not path.is_absolute():
        if ".." in path.parts:
            return None
        base = Path(DATA_MODELS) / model_path.strip("/")
        path = base if base.exists() else base.with_name(base.name + ".gguf")
    if path.is_dir() and not (path / "config.json").is_file():
        return _gguf_of(path)
    return path if path.exists() else None


@lru_cache(maxsize=_CACHE_SIZE)
def _read(path: str, _size: int, _mtime_ns: int) -> ModelFacts | None:
    p = Path(path)
    if p.is_dir():
        template = p / "chat_template.jinja"
        extra = [template.read_text(encoding="utf-8")] if template.is_file() else []
        return facts_from_hf(_json(p / "config.json"), _json(p / "tokenizer_config.json"), extra)
    if p.suffix.lower() != ".gguf":
        return None
    return facts_from_gguf(read_gguf_meta(gguf_shards(p)[0]))


def model_facts(model_path: str) -> ModelFacts | None:
    """What the model at ``model_path`` says about itself; None when it cannot be read
    here (not on this machine, not a model, unreadable)."""
    if not model_path or "\x00" in model_path:
        return None
    try:
        path = _resolve(model_path)
        if path is None:
            return None
        watched = path / "config.json" if path.is_dir() else path
        st = os.stat(watched)
        return _read(str(path), st.st_size, st.st_mtime_ns)
    except Exception as exc:  # a user's path never breaks the caller
        log.debug("no model facts for %s: %s", model_path, exc)
        return None
