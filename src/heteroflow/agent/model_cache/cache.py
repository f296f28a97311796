"""The node's cache of model revisions (issue 29, FEATURES H9), managed by the agent.

Layout under ``root``::

    <key>/                    a complete model revision (``Manifest.cache_key``)
    <key>/.heteroflow-model.json   its marker: the manifest, the bytes on disk
    .incoming/<key>/          a download in progress (``*.part`` files, done files)
    .trash/                   folders being removed

A download fills ``.incoming/<key>``, writes the marker there and renames the folder to
``<key>`` in one step: a reader (an engine, the C10 scan) never sees a half model, and a
folder with a marker is complete after any restart. A download cut by a restart continues
from its ``.part`` files the next time (``download.fetch_file``).

- ``ensure(manifest)`` returns the folder, downloading it once: concurrent callers for one
  key share one asyncio task (and each gets the progress), a failure reaches all of them
  and the next call tries again. Cut connections are retried ``retries`` times, each
  resuming where the last stopped.
- In use: ``acquire(key)``/``release(key)`` (or ``async with cache.use(manifest)``) pin a
  model; a pinned or downloading model is never evicted.
- A disk budget (bytes, None for none): before a download, complete models no task uses
  are evicted least recently used first until the manifest's size fits; when it cannot
  fit, the download fails with reason ``budget`` and nothing is evicted in vain. "Used"
  is the marker's file time, set from the injected clock when a model completes, is
  ensured, acquired or released.
- ``list()`` and ``evict(key)`` for the ``heteroflow models`` verbs to come.

A token is passed to ``ensure`` and sent only to the manifest's origin
(``models.fetch.http``); it is never stored, logged or put in an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import aiohttp

from heteroflow.agent.model_cache.download import (
    RETRYABLE,
    Progress,
    ProgressCallback,
    Tracker,
    fetch_file,
)
from heteroflow.agent.model_cache.unpack import unpack
from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.core.images import size_text
from heteroflow.core.model_sources import CACHE_KEY, SourceKind
from heteroflow.models.fetch.http import Signer, token_form
from heteroflow.models.fetch.manifest import Manifest, SourceFailed

log = logging.getLogger(__name__)

MARKER = ".heteroflow-model.json"
INCOMING = ".incoming"
TRASH = ".trash"


@dataclass(frozen=True, slots=True)
class CachedModel:
    key: str
    source: str
    revision: str
    bytes: int  # on disk when complete; fetched so far while downloading
    last_used: datetime | None
    in_use: int
    state: Literal["complete", "downloading"]


class ModelCache:
    def __init__(
        self,
        root: Path,
        *,
        clock: Clock,
        budget_bytes: int | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        retries: int = 3,
        chunk_bytes: int = 1 << 20,
        progress_interval_s: float = 1.0,
        tls: ssl.SSLContext | bool = True,
    ) -> None:
        self.root = root
        self.tls = tls  # how https is verified: the default CAs, plus the fleet's own
        self.clock = clock
        self.budget_bytes = budget_bytes
        self.retries = retries
        self.chunk_bytes = chunk_bytes
        self.progress_interval_s = progress_interval_s
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self._trackers: dict[str, Tracker] = {}
        self._downloading: dict[str, Manifest] = {}
        self._reserved: dict[str, int] = {}
        self._in_use: Counter[str] = Counter()
        self._hidden = 0
        root.mkdir(parents=True, exist_ok=True)
        self._empty_trash()  # what a removal cut by a restart left

    # -- reading ---------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        return self.root / key

    def entry_path(self, manifest: Manifest) -> Path:
        """What an engine is given: the folder, or the one file of a URL source that is
        not an archive (a ``.gguf`` served as is)."""
        folder = self.path_of(manifest.cache_key)
        src = manifest.source
        if src.kind is SourceKind.URL and not src.archive and len(manifest.files) == 1:
            return folder / manifest.files[0].path
        return folder

    def is_complete(self, key: str) -> bool:
        return (self.root / key / MARKER).is_file()

    def manifest_of(self, key: str) -> Manifest | None:
        """The manifest a complete model was fetched by (its marker's), or None."""
        if not self.is_complete(key):
            return None
        data = _read_marker(self.root / key / MARKER).get("manifest")
        try:
            return Manifest.from_json(data) if isinstance(data, dict) else None
        except (KeyError, TypeError, ValueError, ValidationFailed):  # edited by hand
            return None

    def files_of(self, key: str) -> list[tuple[str, int]]:
        """A complete model's files as they lie (relative path, size): regular files
        only, never a symlink or the marker — what a peer may copy. Blocking."""
        folder = self.path_of(key)
        out: list[tuple[str, int]] = []
        for dirpath, dirnames, filenames in os.walk(folder):  # symlinks are not followed
            dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]
            for name in filenames:
                p = Path(dirpath) / name
                rel = p.relative_to(folder).as_posix()
                if rel == MARKER or p.is_symlink() or not p.is_file():
                    continue
                out.append((rel, p.stat().st_size))
        return sorted(out)

    def list(self) -> list[CachedModel]:
        """Complete models (least recently used first) then downloads in progress."""
        out: list[CachedModel] = []
        for folder in self.root.iterdir():
            marker = folder / MARKER
            if folder.name.startswith(".") or not marker.is_file():
                continue
            data = _read_marker(marker)
            out.append(CachedModel(
                key=folder.name,
                source=str(data.get("manifest", {}).get("source", "")),
                revision=str(data.get("manifest", {}).get("revision", "")),
                bytes=int(data.get("bytes", 0)),
                last_used=datetime.fromtimestamp(marker.stat().st_mtime, UTC),
                in_use=self._in_use[folder.name],
                state="complete",
            ))
        out.sort(key=lambda m: (m.last_used or datetime.min.replace(tzinfo=UTC), m.key))
        for key, tracker in sorted(self._trackers.items()):
            m = self._downloading[key]
            out.append(CachedModel(key, m.source.text, m.revision, tracker.done, None,
                                   self._in_use[key], "downloading"))
        return out

    def progress(self, key: str) -> Progress | None:
        tracker = self._trackers.get(key)
        return tracker.snapshot() if tracker else None

    # -- in use ----------------------------------------------------------------------

    def acquire(self, key: str) -> None:
        """Pin ``key`` (present or not yet): it is not evicted until released."""
        self._in_use[key] += 1
        self._touch(key)

    def release(self, key: str) -> None:
        if self._in_use[key] <= 0:
            raise ValueError(f"model {key} is not acquired")
        self._in_use[key] -= 1
        if not self._in_use[key]:
            del self._in_use[key]
        self._touch(key)

    @asynccontextmanager
    async def use(
        self,
        manifest: Manifest,
        *,
        token: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> AsyncIterator[Path]:
        """Pinned for the block, downloaded first when needed: the model's entry path."""
        key = manifest.cache_key
        self.acquire(key)
        try:
            await self.ensure(manifest, token=token, progress=progress)
            yield self.entry_path(manifest)
        finally:
            self.release(key)

    # -- fetching --------------------------------------------------------------------

    async def ensure(
        self,
        manifest: Manifest,
        *,
        token: str | None = None,
        progress: ProgressCallback | None = None,
        signer: Signer | None = None,
    ) -> Path:
        """The model's folder, complete (see the module). Raises ``SourceFailed``.
        ``signer``: a copy from another node's agent (``manifest.copied_from``) signs its
        requests with the node token instead of sending a hub token."""
        key = manifest.cache_key
        if self.is_complete(key):
            self._touch(key)
            return self.path_of(key)
        task = self._inflight.get(key)
        if task is None or task.done():  # done: a failure whose callback has not run
            task = asyncio.create_task(self._download(manifest, token, signer))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
            self._trackers[key] = self._tracker(manifest)
            self._downloading[key] = manifest
        tracker = self._trackers.get(key)
        if progress is not None and tracker is not None:
            tracker.listeners.append(progress)
        try:
            return await asyncio.shield(task)
        finally:
            if progress is not None and tracker is not None:
                tracker.listeners.remove(progress)

    def _done(self, key: str, task: asyncio.Task[Path]) -> None:
        if self._inflight.get(key) is not task:
            return
        del self._inflight[key]
        self._trackers.pop(key, None)
        self._downloading.pop(key, None)
        self._reserved.pop(key, None)

    def _tracker(self, manifest: Manifest) -> Tracker:
        incoming = self.root / INCOMING / manifest.cache_key
        done = 0
        for f in manifest.files:
            for p in (incoming / f.path, incoming / (f.path + ".part")):
                if p.is_file():
                    done += p.stat().st_size
        total = manifest.total_bytes if manifest.sizes_known else None
        return Tracker(manifest.cache_key, total, done, self.clock, self.progress_interval_s)

    async def _download(
        self, manifest: Manifest, token: str | None, signer: Signer | None
    ) -> Path:
        try:
            return await self._fetch_all(manifest, token, signer)
        except OSError as e:  # the node's disk: full, read-only, permissions
            raise SourceFailed(
                "disk",
                f"task.model_path: this node could not write the model under its cache "
                f"({e.strerror or type(e).__name__})",
            ) from None

    async def _fetch_all(
        self, manifest: Manifest, token: str | None, signer: Signer | None
    ) -> Path:
        key = manifest.cache_key
        self._make_room(key, manifest.total_bytes)
        await asyncio.to_thread(self._empty_trash)
        incoming = self.root / INCOMING / key
        incoming.mkdir(parents=True, exist_ok=True)
        tracker = self._trackers[key]
        form = token_form(manifest.source.kind)
        async with aiohttp.ClientSession(
            timeout=self.timeout, connector=aiohttp.TCPConnector(ssl=self.tls)
        ) as session:
            for f in manifest.files:
                final = incoming / f.path
                if final.is_file() and (f.size is None or final.stat().st_size == f.size):
                    continue  # fetched and checked before a restart
                for attempt in range(self.retries + 1):
                    try:
                        await fetch_file(
                            session, f, final, token=token, tracker=tracker, form=form,
                            chunk_bytes=self.chunk_bytes, timeout=self.timeout,
                            signer=signer,
                        )
                        break
                    except SourceFailed as e:
                        if e.reason not in RETRYABLE or attempt == self.retries:
                            raise
                        log.warning("model %s: %s (try %d of %d)", key, e.message,
                                    attempt + 2, self.retries + 1)
        if manifest.source.archive and not manifest.copied_from:  # a copy is unpacked
            archive = incoming / manifest.files[0].path
            await asyncio.to_thread(unpack, archive, manifest.source.archive, incoming)
        tracker.file = ""
        tracker.emit()
        return await asyncio.to_thread(self._complete, manifest, incoming)

    def _complete(self, manifest: Manifest, incoming: Path) -> Path:
        key = manifest.cache_key
        size = sum(p.stat().st_size for p in incoming.rglob("*") if p.is_file())
        body = {"manifest": manifest.to_json(), "bytes": size,
                "completed_at": self.clock.now().isoformat()}
        tmp = incoming / (MARKER + ".tmp")
        tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
        os.replace(tmp, incoming / MARKER)
        final = self.path_of(key)
        if final.exists():  # a folder without a marker: a leftover, never a model
            self._discard(final)
        os.replace(incoming, final)
        self._touch(key)
        log.info("model %s complete: %s in %d files", key, size_text(size),
                 len(manifest.files))
        return final

    # -- budget and eviction ---------------------------------------------------------

    def _make_room(self, key: str, need: int) -> None:
        budget = self.budget_bytes
        if budget is None:
            return
        held = [m for m in self.list() if m.state == "complete"]
        reserved = sum(v for k, v in self._reserved.items() if k != key)
        used = sum(m.bytes for m in held) + reserved
        free_able = [m for m in held if not m.in_use and m.key not in self._inflight]
        if used - sum(m.bytes for m in free_able) + need > budget:
            raise SourceFailed(
                "budget",
                f"task.model_path: the model needs {size_text(need)}; this node's model "
                f"cache budget is {size_text(budget)}, of which "
                f"{size_text(used - sum(m.bytes for m in free_able))} is held by models "
                "in use or downloading",
            )
        for m in free_able:  # least recently used first (``list`` order)
            if used + need <= budget:
                break
            log.info("model cache: evicting %s (%s, least recently used) for %s",
                     m.key, size_text(m.bytes), key)
            self._hide(self.path_of(m.key))  # removed by the download, off the loop
            used -= m.bytes
        self._reserved[key] = need

    def evict(self, key: str) -> None:
        """Remove a complete model no task uses: ``Conflict`` when in use or
        downloading, ``NotFound`` when the node does not hold it. Blocking (the files
        are removed before it returns): an async caller runs it in a thread."""
        if not CACHE_KEY.match(key):  # never a path: "..", ".trash" are not models
            raise NotFound(f"this node holds no model {key!r}", field="key")
        if self._in_use[key] or key in self._inflight:
            raise Conflict(f"model {key} is in use or downloading on this node", field="key")
        if not self.is_complete(key):
            raise NotFound(f"this node holds no model {key}", field="key")
        self._discard(self.path_of(key))

    def _discard(self, folder: Path) -> None:
        """Out of sight in one rename, then removed (blocking: a big model's files)."""
        shutil.rmtree(self._hide(folder), ignore_errors=True)

    def _hide(self, folder: Path) -> Path:
        """Out of sight in one rename, so no reader or ``ensure`` finds it any more."""
        trash = self.root / TRASH
        trash.mkdir(exist_ok=True)
        self._hidden += 1
        target = trash / f"{folder.name}.{os.getpid()}.{self._hidden}"
        os.replace(folder, target)
        return target

    def _empty_trash(self) -> None:
        trash = self.root / TRASH
        if trash.is_dir():
            for p in trash.iterdir():
                shutil.rmtree(p, ignore_errors=True)

    def _touch(self, key: str) -> None:
        marker = self.root / key / MARKER
        if marker.is_file():
            t = self.clock.now().timestamp()
            os.utime(marker, (t, t))


def _read_marker(marker: Path) -> dict[str, Any]:
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
