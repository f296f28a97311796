"""An archive source unpacked in its cache folder (``.tar``, ``.tar.gz``/``.tgz``, ``.zip``).

An archive is input from outside: tar members go through Python's ``data`` filter
(no absolute names, no ``..``, no links out of the folder, no devices, no set-uid bits),
zip members are checked with the manifest's own path rule and links are refused. A
refused archive fails with reason ``invalid``, naming the member.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from pathlib import Path

from heteroflow.models.fetch.manifest import SourceFailed, safe_relative


def unpack(archive: Path, suffix: str, dest: Path) -> None:
    """Unpack ``archive`` into ``dest`` and remove it. Blocking: run it in a thread."""
    try:
        if suffix == ".zip":
            _unzip(archive, dest)
        else:
            with tarfile.open(archive, "r:*") as tf:
                tf.extractall(dest, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise SourceFailed(
            "invalid",
            f"task.model_path: the archive {archive.name} could not be unpacked "
            f"({type(e).__name__}: {e})",
        ) from None
    archive.unlink()


def _unzip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            name = info.filename.rstrip("/")
            if safe_relative(name) is None:
                raise SourceFailed("invalid", f"task.model_path: the archive "
                                   f"{archive.name} holds an unsafe name {name!r}")
            if stat.S_ISLNK(info.external_attr >> 16):
                raise SourceFailed("invalid", f"task.model_path: the archive "
                                   f"{archive.name} holds a link {name!r}")
        zf.extractall(dest)  # noqa: S202 (every name checked above)
