"""One file of a model fetched into the node's cache: resumed, checked, then renamed.

The bytes go to ``{name}.part``; a ``.part`` left by a cut connection or a restart is
continued with ``Range: bytes={have}-`` (a 206 answer appends; a server that answers 200
ignores ranges, and the file starts over). At the end the file is checked — its SHA-256
when the manifest gives one, else its size — fsynced and renamed to its name, so nothing
ever sees a half file under the real name. A mismatch removes the ``.part`` (a resume
would only extend wrong bytes) and fails with reason ``checksum``.

Disk writes and hashing run in a worker thread, one chunk at a time: the agent's event
loop also beats the heartbeat, and hashing a gigabyte takes seconds.

``Progress`` is what the task status will show: bytes done and total (None when a size is
unknown), the rate over this download (resumed bytes do not count as speed) and the ETA.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import aiohttp

from heteroflow.core.clock import Clock
from heteroflow.models.fetch.http import Signer, TokenForm, request, shown, status_failure
from heteroflow.models.fetch.manifest import ManifestFile, Reason, SourceFailed

log = logging.getLogger(__name__)

RETRYABLE = frozenset({"unreachable", "timeout"})


@dataclass(frozen=True, slots=True)
class Progress:
    key: str
    done_bytes: int
    total_bytes: int | None
    rate_bps: float  # bytes per second over this download
    eta_s: float | None  # None while the rate or the total is unknown
    file: str  # the file being fetched ('' once complete)


ProgressCallback = Callable[[Progress], None]


class Tracker:
    """Bytes done for one model's download; reports at most every ``interval_s``."""

    def __init__(
        self, key: str, total: int | None, done: int, clock: Clock, interval_s: float
    ) -> None:
        self.key, self.total, self.done = key, total, done
        self.clock, self.interval_s = clock, interval_s
        self.started = clock.monotonic()
        self.fetched = 0  # bytes that came over the network in this download
        self.file = ""
        self._last: float | None = None
        self.listeners: list[ProgressCallback] = []

    def add(self, n: int) -> None:
        self.done += n
        self.fetched += n
        now = self.clock.monotonic()
        if self._last is None or now - self._last >= self.interval_s:
            self.emit(now)

    def rewind(self, n: int) -> None:
        """A partial file that had to start over: its bytes are not done any more."""
        self.done -= n

    def snapshot(self, now: float | None = None) -> Progress:
        now = self.clock.monotonic() if now is None else now
        elapsed = now - self.started
        rate = self.fetched / elapsed if elapsed > 0 else 0.0
        eta = None
        if self.total is not None and rate > 0:
            eta = max(self.total - self.done, 0) / rate
        return Progress(self.key, self.done, self.total, rate, eta, self.file)

    def emit(self, now: float | None = None) -> None:
        p = self.snapshot(now)
        self._last = self.clock.monotonic() if now is None else now
        for listener in list(self.listeners):
            try:
                listener(p)
            except Exception:  # a listener's bug must not fail the download
                log.exception("model cache progress listener failed")


def _hash_file(path: Path, hasher: hashlib._Hash) -> None:
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            hasher.update(chunk)


def _write(fh: BinaryIO, chunk: bytes, hasher: hashlib._Hash | None) -> None:
    fh.write(chunk)
    if hasher is not None:
        hasher.update(chunk)


def _finish(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()


async def fetch_file(
    session: aiohttp.ClientSession,
    f: ManifestFile,
    final: Path,
    *,
    token: str | None,
    form: TokenForm = "bearer",
    tracker: Tracker,
    chunk_bytes: int,
    timeout: aiohttp.ClientTimeout,
    signer: Signer | None = None,
) -> None:
    """Fetch ``f`` to ``final`` (see the module). Raises ``SourceFailed``; a reason in
    ``RETRYABLE`` leaves the ``.part`` for the next try to continue."""
    part = final.with_name(final.name + ".part")
    final.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if f.size is not None and have > f.size:
        part.unlink()
        tracker.rewind(have)
        have = 0
    hasher = hashlib.sha256() if f.sha256 else None
    if have and hasher is not None:
        await asyncio.to_thread(_hash_file, part, hasher)
    tracker.file = f.path
    if f.size is None or have < f.size:
        headers = {"Range": f"bytes={have}-"} if have else {}
        async with request(
            session, "GET", f.url, token=token, form=form, headers=headers, timeout=timeout,
            signer=signer,
        ) as resp:
            if resp.status == 416:
                part.unlink(missing_ok=True)
                tracker.rewind(have)
                raise SourceFailed("unreachable", f"task.model_path: {shown(f.url)} "
                                   "refused the resume range; starting the file over")
            if resp.status == 206 and have:
                start = resp.headers.get("Content-Range", "").removeprefix("bytes ")
                if not start.startswith(f"{have}-"):
                    raise SourceFailed("invalid", f"task.model_path: {shown(f.url)} "
                                       "answered a range that was not asked for")
            elif resp.status == 200:
                if have:  # the server ignores ranges: start over
                    tracker.rewind(have)
                    have = 0
                    hasher = hashlib.sha256() if f.sha256 else None
            else:
                raise status_failure(resp.status, f.url, f.path)
            fh = part.open("ab" if have else "wb")
            try:
                written = have
                async for chunk in resp.content.iter_chunked(chunk_bytes):
                    await asyncio.to_thread(_write, fh, chunk, hasher)
                    written += len(chunk)
                    tracker.add(len(chunk))
                    if f.size is not None and written > f.size:
                        raise _mismatch(part, f, f"more than its {f.size} bytes")
            except (aiohttp.ClientError, TimeoutError) as e:
                reason: Reason = "timeout" if isinstance(e, TimeoutError) else "unreachable"
                raise SourceFailed(
                    reason, f"task.model_path: the download of {f.path} from "
                    f"{shown(f.url)} was cut ({type(e).__name__}); it resumes"
                ) from None
            finally:
                await asyncio.to_thread(_finish, fh)
    got = part.stat().st_size
    if f.size is not None and got < f.size:
        raise SourceFailed("unreachable", f"task.model_path: the download of {f.path} "
                           f"ended at {got} of {f.size} bytes; it resumes")
    if hasher is not None and hasher.hexdigest() != f.sha256:
        raise _mismatch(part, f, f"SHA-256 {hasher.hexdigest()}, the source gives {f.sha256}")
    os.replace(part, final)


def _mismatch(part: Path, f: ManifestFile, what: str) -> SourceFailed:
    part.unlink(missing_ok=True)
    return SourceFailed(
        "checksum",
        f"task.model_path: {f.path} does not match its source ({what}); the downloaded "
        "bytes were removed",
    )
