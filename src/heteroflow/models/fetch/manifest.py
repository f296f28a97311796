"""What a model source resolves to (issue 29): the files to fetch, and why a fetch failed.

A ``Manifest`` is data: the source, the resolved revision (a hub's commit; '' where the
source has none), and each file's relative path, size and SHA-256 when the source gives
them, with the URL to fetch it from. It carries no credential: the token is handed to
whoever fetches, beside the manifest, so the manifest can be written to disk (the node
cache's completion marker) and shown.

``SourceFailed`` is a ``ValidationFailed`` naming ``task.model_path`` (a source that does
not resolve is a 400 on create and dry run), with ``reason`` one of ``REASONS`` so the
caller can tell "not there" from "not allowed" from "could not ask". Its message never
holds a token: the code that raises it builds the text itself.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.model_sources import FIELD, ModelSource, SourceKind, parse_model_source

Reason = Literal[
    "not_found", "unauthorized", "unreachable", "timeout", "invalid", "unsupported",
    "insecure", "checksum", "budget", "disk",
]
REASONS: tuple[Reason, ...] = (
    "not_found", "unauthorized", "unreachable", "timeout", "invalid", "unsupported",
    "insecure", "checksum", "budget", "disk",
)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class SourceFailed(ValidationFailed):
    """A source that could not be resolved or fetched; ``reason`` says which way."""

    def __init__(self, reason: Reason, message: str, *, field: str = FIELD) -> None:
        super().__init__(message, field=field)
        self.reason = reason


def safe_relative(path: str) -> str | None:
    """``path`` if it is a plain relative file path (no ``..``, not absolute, no empty or
    ``.`` segment, no backslash or control character), else None: a hub's listing is
    input, and a name like ``../../etc/cron.d/x`` must not leave the model's folder."""
    if not path or path.startswith("/") or "\\" in path or len(path) > 4096:
        return None
    if re.search(r"[\x00-\x1f\x7f]", path):
        return None
    segments = path.split("/")
    if any(s in ("", ".", "..") or len(s.encode()) > 255 for s in segments):
        return None
    if posixpath.normpath(path) != path:
        return None
    return path


@dataclass(frozen=True, slots=True)
class ManifestFile:
    path: str  # relative to the model's folder, checked by ``safe_relative``
    size: int | None
    sha256: str | None
    url: str

    def __post_init__(self) -> None:
        if safe_relative(self.path) is None:
            raise ValueError(f"unsafe file path in a manifest: {self.path!r}")
        if self.sha256 is not None and not _SHA256.match(self.sha256):
            raise ValueError(f"not a sha256: {self.sha256!r}")
        if self.size is not None and self.size < 0:
            raise ValueError("negative size")


@dataclass(frozen=True, slots=True)
class Manifest:
    source: ModelSource
    revision: str  # the resolved revision (a hub's commit sha); '' when there is none
    files: tuple[ManifestFile, ...]
    # a copy from another node's cache (issue 29): that node's name; its files are the
    # model as it lies there (an archive source's already unpacked)
    copied_from: str = ""

    @property
    def total_bytes(self) -> int:
        """The sum of the known sizes (a file of unknown size counts 0)."""
        return sum(f.size or 0 for f in self.files)

    @property
    def sizes_known(self) -> bool:
        return all(f.size is not None for f in self.files)

    @property
    def cache_key(self) -> str:
        """One folder per resolved revision: ``@main`` and ``@<its commit>`` share it."""
        return self.source.pinned(self.revision).cache_key

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source.text,
            "revision": self.revision,
            **({"copied_from": self.copied_from} if self.copied_from else {}),
            "files": [
                {"path": f.path, "size": f.size, "sha256": f.sha256, "url": f.url}
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            source=parse_model_source(str(data["source"])),
            revision=str(data.get("revision") or ""),
            copied_from=str(data.get("copied_from") or ""),
            files=tuple(
                ManifestFile(
                    path=str(f["path"]),
                    size=None if f.get("size") is None else int(f["size"]),
                    sha256=f.get("sha256"),
                    url=str(f["url"]),
                )
                for f in data["files"]
            ),
        )


class Resolver(Protocol):
    """A source → its manifest (the edge: a hub's API, a web server's HEAD)."""

    async def resolve(self, source: ModelSource, token: str | None = None) -> Manifest:
        """Raises ``SourceFailed``."""
        ...


class StaticResolver:
    """The fake beside the real resolver: manifests known in advance, by source text."""

    def __init__(self, manifests: dict[str, Manifest]) -> None:
        self.manifests = manifests
        self.calls: list[str] = []

    async def resolve(self, source: ModelSource, token: str | None = None) -> Manifest:
        self.calls.append(source.text)
        if source.kind is SourceKind.PATH:
            raise SourceFailed("unsupported", f"{FIELD}: a path is read, not resolved")
        found = self.manifests.get(source.text)
        if found is None:
            raise SourceFailed("not_found", f"{FIELD}: {source.text} was not found")
        return found
