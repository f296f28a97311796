"""Serving file requests on the node (FEATURES C7): list a directory or upload a file.

The agent is the security boundary: the file lives here, so every claimed request is
checked again on this machine before anything is read — the path's form
(``core.paths.validate_target``), then that its ``realpath`` lies inside the task's
host directories (also resolved), on path-segment boundaries. A symlink that leads
out of a root is refused, and the file is opened with ``O_NOFOLLOW`` and must be a
regular file. Listings are non-recursive; entries are described without following
symlinks (a link says nothing about its target).

Uploads go in chunks of ``chunk_bytes`` (64 MiB by default, at most the server's
``file_chunk_bytes``) numbered from 0; the server checks the total against the size
reported at the end. Every refusal or I/O error is reported as ``failed`` with the
reason. A download can take a while: run this in its own loop, not inside the
heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable
from typing import Protocol

from heteroflow.agent.client import ServerError
from heteroflow.agent.models import ModelPathError, resolve_model_file
from heteroflow.core.paths import inside, validate_target
from heteroflow.core.states import FileOutcome, FileRequestStatus
from heteroflow.schemas.files import MAX_LIST_ENTRIES, AgentFileRequest, FileEntry, ListResult

log = logging.getLogger(__name__)

RootsForTask = Callable[[str], list[str]]


class FileRequestClient(Protocol):
    """What serving needs from the server (``agent.client.ServerClient`` has it)."""

    async def file_requests(self) -> list[AgentFileRequest]: ...

    async def file_chunk(self, request_id: str, seq: int, data: bytes) -> None: ...

    async def file_done(
        self,
        request_id: str,
        status: FileOutcome,
        *,
        error: str = "",
        result: ListResult | None = None,
        size_bytes: int = 0,
    ) -> str: ...


class Refused(Exception):
    """The request may not be served; the message is the reason the user sees."""


def process_roots(model_path: str, allowed: tuple[str, ...], denied: tuple[str, ...]) -> list[str]:
    """The process runtime's root for a task: the folder of the model file it runs."""
    try:
        return [os.path.dirname(resolve_model_file(model_path, allowed, denied))]
    except ModelPathError:
        return []


def resolve_target(path: str, roots: list[str]) -> str:
    """The real path to serve, or Refused: its form, then containment after realpath."""
    reason = validate_target(path)
    if reason:
        raise Refused(reason)
    if not roots:
        raise Refused("the task is not running on this node (no directories to serve)")
    real = os.path.realpath(path)
    real_roots = [os.path.realpath(r) for r in roots]
    if not inside(real, real_roots):
        shown = f"{path} (resolves to {real})" if real != path else path
        raise Refused(f"{shown} is outside the task's directories ({', '.join(real_roots)})")
    return real


def list_dir(real: str) -> ListResult:
    if not os.path.isdir(real):
        raise Refused(f"{real} is not a directory")
    entries: list[FileEntry] = []
    with os.scandir(real) as it:
        names = sorted(it, key=lambda e: e.name)
    for e in names[:MAX_LIST_ENTRIES]:
        st = e.stat(follow_symlinks=False)
        entries.append(
            FileEntry(
                name=e.name,
                size=st.st_size,
                is_dir=stat.S_ISDIR(st.st_mode),
                mtime=st.st_mtime,
            )
        )
    return ListResult(entries=entries, truncated=len(names) > MAX_LIST_ENTRIES)


def _open_regular(real: str) -> int:
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"{real} is not a regular file")
    return fd


async def _upload(client: FileRequestClient, request_id: str, real: str, chunk_bytes: int) -> int:
    fd = await asyncio.to_thread(_open_regular, real)
    total, seq = 0, 0
    with os.fdopen(fd, "rb") as f:
        while True:
            data = await asyncio.to_thread(f.read, chunk_bytes)
            if not data:
                return total
            await client.file_chunk(request_id, seq, data)
            total += len(data)
            seq += 1


async def _fail(client: FileRequestClient, request_id: str, reason: str) -> None:
    try:
        await client.file_done(request_id, FileRequestStatus.FAILED, error=reason)
    except Exception as exc:  # the server fails it after file_request_timeout_s
        log.warning("could not report file request %s as failed: %s", request_id, exc)


async def serve_one(
    client: FileRequestClient,
    req: AgentFileRequest,
    allowed_roots_for_task: RootsForTask,
    chunk_bytes: int,
) -> None:
    try:
        real = resolve_target(req.target_path, allowed_roots_for_task(req.task_id))
        if req.request_type == "list":
            listing = await asyncio.to_thread(list_dir, real)
            await client.file_done(req.id, FileRequestStatus.DONE, result=listing)
        else:
            size = await _upload(client, req.id, real, chunk_bytes)
            await client.file_done(req.id, FileRequestStatus.DONE, size_bytes=size)
    except Refused as exc:
        await _fail(client, req.id, str(exc))
    except OSError as exc:
        await _fail(client, req.id, f"{req.target_path}: {exc.strerror or exc}")
    except ServerError as exc:
        if exc.status in (404, 409):  # the server moved on (request expired, task gone)
            log.info("file request %s dropped: %s", req.id, exc)
        else:
            await _fail(client, req.id, f"the server refused the upload: {exc}")
    except Exception as exc:  # network trouble mid-upload
        log.warning("file request %s interrupted: %s", req.id, exc)
        await _fail(client, req.id, f"upload interrupted: {exc}")


async def serve_file_requests(
    client: FileRequestClient, allowed_roots_for_task: RootsForTask, chunk_bytes: int
) -> int:
    """Claim this node's pending requests and serve each; returns how many were claimed."""
    try:
        claimed = await client.file_requests()
    except Exception as exc:
        log.warning("could not fetch file requests: %s", exc)
        return 0
    for req in claimed:
        await serve_one(client, req, allowed_roots_for_task, chunk_bytes)
    return len(claimed)
