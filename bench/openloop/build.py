"""Build the open-loop generator (``openloop.c``) once per version of its source.

The binary goes to ``CACHE/openloop-<hash>`` (``CACHE``: ``$OPENLOOP_CACHE``, else
``bench/results/.openloop``, which git ignores), where ``<hash>`` covers the source and
the compiler command: an unchanged source is not compiled again, an edited one is.

    python bench/openloop/build.py          # prints the binary's path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "openloop.c"
DEFAULT_CACHE = Path(__file__).resolve().parents[1] / "results" / ".openloop"
CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"]


def ensure_built(cache: Path | None = None) -> Path:
    """The path of a binary built from the current ``openloop.c`` (compiled if needed)."""
    cache = cache or Path(os.environ.get("OPENLOOP_CACHE") or DEFAULT_CACHE)
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("bench/openloop needs a C compiler (gcc or cc) on PATH")
    cmd = [cc, *CFLAGS]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(cmd).encode()).hexdigest()[:16]
    binary = cache / f"openloop-{digest}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(f".tmp{os.getpid()}")
    subprocess.run([*cmd, "-o", str(tmp), str(SOURCE), "-lm"], check=True)
    tmp.replace(binary)  # atomic: a concurrent build never sees half a binary
    return binary


if __name__ == "__main__":
    print(ensure_built(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
