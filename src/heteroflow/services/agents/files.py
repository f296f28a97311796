"""File requests (FEATURES C7): list a directory or download a file from a task's node.

The flow is asynchronous: a user creates a request (``pending``); the agent of the
task's node claims it by compare-and-set (``pending -> running``, exactly one claim
wins), uploads the file in numbered chunks or sends the listing, and reports
``done`` or ``failed``; the user polls the request and then streams the content back.

Requests and chunks live in the database, not in the server's data dir: the spec
allows the data dir for a single server, but with several server instances on one
PostgreSQL the agent's upload and the user's download may reach different instances,
and the database serves both cases. Chunks are read back one at a time, so a download
never holds more than one chunk (``file_chunk_bytes``, 64 MiB) in server memory.

Paths are checked here (form, then inside a directory the task mounts — see
``core.paths``) to refuse mistakes early; the agent checks again on the real file
system, resolving symlinks, because only it can.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from datetime import timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound, PayloadTooLarge, ValidationFailed
from heteroflow.core.ids import new_id
from heteroflow.core.paths import inside, task_roots, validate_target
from heteroflow.core.states import AGENT_OWNED, TERMINAL, FileRequestStatus, TaskStatus
from heteroflow.db.engine import Database
from heteroflow.db.tables import FileRequest, FileRequestChunk, Node, Task
from heteroflow.schemas.files import (
    AgentFileRequest,
    FileRequestCreate,
    FileRequestCreated,
    FileRequestDone,
    FileRequestRead,
    ListResult,
)
from heteroflow.services.identity.access import task_on_node, visible_file_request, visible_task
from heteroflow.services.identity.auth import Principal

F = FileRequestStatus
OPEN = frozenset({F.PENDING, F.RUNNING})  # someone may still finish it
CLAIM_BATCH = 16
# A request waits for (scheduled) or is served by (starting, running) the task's agent.
SERVABLE = frozenset({TaskStatus.SCHEDULED, *AGENT_OWNED})


def create(s: Session, who: Principal, clock: Clock, req: FileRequestCreate) -> FileRequestCreated:
    t = visible_task(s, who, req.task_id)
    reason = validate_target(req.target_path)
    if reason:
        raise ValidationFailed(reason, field="target_path")
    node = s.get(Node, t.node_id) if t.node_id else None
    if node is None or TaskStatus(t.status) not in SERVABLE:
        raise Conflict(
            f"task {t.id} is {t.status}: files can be requested only from a task "
            "placed on a node and not stopping"
        )
    roots = task_roots(
        t.model_path, t.engine, node.runtime, [str(v["host_path"]) for v in t.volumes]
    )
    if not inside(req.target_path, roots):
        where = ", ".join(roots) if roots else "(the task mounts no host directory)"
        raise ValidationFailed(
            f"target_path must be inside a directory the task mounts: {where}",
            field="target_path",
        )
    now = clock.now()
    fr = FileRequest(
        id=new_id("fr"),
        task_id=t.id,
        tenant_id=t.tenant_id,
        requested_by=who.user_id,
        request_type=req.request_type,
        target_path=req.target_path,
        status=F.PENDING.value,
        error="",
        result={},
        size_bytes=0,
        created_at=now,
        updated_at=now,
    )
    s.add(fr)
    s.flush()
    return FileRequestCreated(id=fr.id, status=F.PENDING)


def _move(
    s: Session,
    clock: Clock,
    request_id: str,
    expected: FileRequestStatus,
    to: FileRequestStatus,
    *,
    error: str | None = None,
    result: dict[str, object] | None = None,
) -> bool:
    """Compare-and-set of a request's status; False when someone moved it first.
    ``error`` / ``result`` are written when given."""
    extra: dict[str, object] = {}
    if error is not None:
        extra["error"] = error
    if result is not None:
        extra["result"] = result
    outcome = s.execute(
        update(FileRequest)
        .where(FileRequest.id == request_id, FileRequest.status == expected.value)
        .values(status=to.value, updated_at=clock.now(), **extra)
        .execution_options(synchronize_session=False)
    )
    return outcome.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def _expire(s: Session, clock: Clock, fr: FileRequest, timeout_s: float) -> None:
    """Fail a request nobody can finish any more: its task ended, or no progress."""
    current = F(fr.status)
    if current not in OPEN:
        return
    status = s.scalar(select(Task.status).where(Task.id == fr.task_id))
    if status is None or TaskStatus(status) in TERMINAL:
        error = f"the task is {status or 'gone'}"
    elif clock.now() - fr.updated_at > timedelta(seconds=timeout_s):
        error = f"no progress for {timeout_s:.0f} s (is the task's node online?)"
    else:
        return
    if _move(s, clock, fr.id, current, F.FAILED, error=error):
        _drop_chunks(s, fr.id)
    s.refresh(fr)


def _drop_chunks(s: Session, request_id: str) -> None:
    s.execute(
        delete(FileRequestChunk)
        .where(FileRequestChunk.request_id == request_id)
        .execution_options(synchronize_session=False)
    )


def _read(fr: FileRequest) -> FileRequestRead:
    listing = ListResult.model_validate(fr.result) if fr.result else None
    return FileRequestRead(
        id=fr.id,
        task_id=fr.task_id,
        request_type=fr.request_type,
        target_path=fr.target_path,
        status=F(fr.status),
        error=fr.error,
        entries=listing.entries if listing else None,
        truncated=listing.truncated if listing else False,
        size_bytes=fr.size_bytes,
        created_at=fr.created_at,
        updated_at=fr.updated_at,
    )


def get(
    s: Session, who: Principal, clock: Clock, request_id: str, timeout_s: float
) -> FileRequestRead:
    fr = visible_file_request(s, who, request_id)
    _expire(s, clock, fr, timeout_s)
    return _read(fr)


def content_of(
    s: Session, who: Principal, clock: Clock, request_id: str, timeout_s: float
) -> tuple[str, int]:
    """(file name, size) of a finished download; 409 until it is done."""
    fr = visible_file_request(s, who, request_id)
    _expire(s, clock, fr, timeout_s)
    if fr.request_type != "download":
        raise Conflict(f"file request {fr.id} is a listing: read its entries instead")
    if fr.status != F.DONE:
        detail = f": {fr.error}" if fr.error else "; poll until it is done"
        raise Conflict(f"file request {fr.id} is {fr.status}{detail}")
    return posixpath.basename(fr.target_path.rstrip("/")) or "download", fr.size_bytes


def iter_chunks(db: Database, request_id: str) -> Iterator[bytes]:
    """The stored chunks in order, one database read (and one chunk in memory) at a time."""
    seq = 0
    while True:
        with db.session() as s:
            data = s.scalar(
                select(FileRequestChunk.data).where(
                    FileRequestChunk.request_id == request_id, FileRequestChunk.seq == seq
                )
            )
        if data is None:
            return
        yield bytes(data)
        seq += 1


# -- the agent's side -----------------------------------------------------------------
def claim_pending(s: Session, clock: Clock, node_id: str) -> list[AgentFileRequest]:
    """Pending requests for tasks this node runs, each claimed (pending -> running)."""
    rows = s.scalars(
        select(FileRequest)
        .join(Task, Task.id == FileRequest.task_id)
        .where(
            Task.node_id == node_id,
            Task.status.in_([st.value for st in AGENT_OWNED]),
            FileRequest.status == F.PENDING.value,
        )
        .order_by(FileRequest.created_at)
        .limit(CLAIM_BATCH)
    )
    return [
        AgentFileRequest.model_validate(fr, from_attributes=True)
        for fr in list(rows)
        if _move(s, clock, fr.id, F.PENDING, F.RUNNING)
    ]


def _claimed(s: Session, node_id: str, request_id: str) -> FileRequest:
    fr = s.get(FileRequest, request_id)
    if fr is None:
        raise NotFound(f"file request {request_id!r} not found")
    task_on_node(s, node_id, fr.task_id)
    if fr.status != F.RUNNING:
        raise Conflict(f"file request {fr.id} is {fr.status}, not running")
    return fr


def store_chunk(
    s: Session,
    clock: Clock,
    node_id: str,
    request_id: str,
    seq: int,
    data: bytes,
    max_total: int,
) -> int:
    """Keep one uploaded chunk (a resent seq replaces itself); returns bytes so far."""
    fr = _claimed(s, node_id, request_id)
    if fr.request_type != "download":
        raise Conflict(f"file request {fr.id} is a listing; it takes no chunks")
    if seq < 0:
        raise ValidationFailed("X-Chunk-Seq must be 0 or more", field="X-Chunk-Seq")
    old = s.get(FileRequestChunk, (fr.id, seq))
    total = fr.size_bytes - (len(old.data) if old else 0) + len(data)
    if total > max_total:
        raise PayloadTooLarge(f"the file is over the server's limit of {max_total} bytes")
    if old is not None:
        old.data = data
    else:
        s.add(FileRequestChunk(request_id=fr.id, seq=seq, data=data))
    fr.size_bytes = total
    fr.updated_at = clock.now()
    s.flush()
    return total


def finish(
    s: Session, clock: Clock, node_id: str, request_id: str, done: FileRequestDone
) -> FileRequestStatus:
    """The agent's outcome; a download is checked against what actually arrived."""
    fr = _claimed(s, node_id, request_id)
    status: FileRequestStatus = done.status
    error = done.error
    result: dict[str, object] = {}
    if status == F.DONE and fr.request_type == "list":
        result = (done.result or ListResult()).model_dump()
    elif status == F.DONE:
        count, top = s.execute(
            select(func.count(), func.max(FileRequestChunk.seq)).where(
                FileRequestChunk.request_id == fr.id
            )
        ).one()
        if fr.size_bytes != done.size_bytes or (count and top != count - 1):
            status = F.FAILED
            error = (
                f"upload incomplete: received {fr.size_bytes} bytes in {count} chunk(s), "
                f"the agent sent {done.size_bytes}"
            )
    if status == F.FAILED:
        error = error or "failed on the node (no reason given)"
    if not _move(s, clock, fr.id, F.RUNNING, status, error=error, result=result):
        raise Conflict(f"file request {fr.id} changed concurrently")
    if status == F.FAILED:
        _drop_chunks(s, fr.id)
    return status
