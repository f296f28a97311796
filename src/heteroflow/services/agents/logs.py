"""Task logs (FEATURES C6): agents append chunks, users page through or follow them.

Chunks are numbered per task from 1 (``seq``) and never rewritten. Each task keeps the
newest ``task_log_max_bytes`` (8 MiB by default): when an append goes over, the oldest
chunks are deleted — the newest chunk always stays, and ``after=`` paging simply
continues from whatever is left. One append carries at most ``log_append_max_bytes``
(1 MiB) of UTF-8 text; more is refused with 413 and the agent splits its output.

The live view (``follow``) polls the database, so it works the same when the agent
talks to another server instance than the reader.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import PayloadTooLarge
from heteroflow.core.states import TERMINAL, TaskStatus
from heteroflow.db.engine import Database
from heteroflow.db.tables import Task, TaskLog
from heteroflow.schemas.logs import LogChunkRead, LogPage
from heteroflow.services.identity.access import task_on_node, visible_task
from heteroflow.services.identity.auth import Principal


def append(
    s: Session,
    clock: Clock,
    node_id: str,
    task_id: str,
    text: str,
    *,
    max_bytes: int,
    keep_bytes: int,
) -> int:
    """Store one chunk from the task's agent; returns its seq (0 when ``text`` is empty)."""
    size = len(text.encode("utf-8", "replace"))
    if size > max_bytes:
        raise PayloadTooLarge(
            f"log text is {size} bytes; at most {max_bytes} per call", field="text"
        )
    task_on_node(s, node_id, task_id)
    if not text:
        return 0
    last = s.scalar(select(func.max(TaskLog.seq)).where(TaskLog.task_id == task_id)) or 0
    seq = int(last) + 1
    s.add(TaskLog(task_id=task_id, seq=seq, text=text, size_bytes=size, created_at=clock.now()))
    s.flush()
    _trim(s, task_id, keep_bytes)
    return seq


def _trim(s: Session, task_id: str, keep_bytes: int) -> None:
    total = s.scalar(select(func.sum(TaskLog.size_bytes)).where(TaskLog.task_id == task_id))
    if not total or int(total) <= keep_bytes:
        return
    kept, cut = 0, 0
    rows = s.execute(
        select(TaskLog.seq, TaskLog.size_bytes)
        .where(TaskLog.task_id == task_id)
        .order_by(TaskLog.seq.desc())
    )
    for seq, size in rows:
        if kept and kept + size > keep_bytes:
            cut = seq
            break
        kept += size
    if cut:
        s.execute(
            delete(TaskLog)
            .where(TaskLog.task_id == task_id, TaskLog.seq <= cut)
            .execution_options(synchronize_session=False)
        )


def _page(s: Session, task_id: str, after: int, limit: int) -> LogPage:
    rows = list(
        s.scalars(
            select(TaskLog)
            .where(TaskLog.task_id == task_id, TaskLog.seq > after)
            .order_by(TaskLog.seq)
            .limit(limit)
        )
    )
    chunks = [LogChunkRead(seq=r.seq, text=r.text, created_at=r.created_at) for r in rows]
    return LogPage(chunks=chunks, next=chunks[-1].seq if chunks else after)


def read(s: Session, who: Principal, task_id: str, after: int, limit: int) -> LogPage:
    visible_task(s, who, task_id)
    return _page(s, task_id, after, limit)


def _poll(db: Database, task_id: str, after: int, limit: int) -> tuple[LogPage, bool]:
    """New chunks and whether the task had already ended before they were read."""
    with db.session() as s:
        status = s.scalar(select(Task.status).where(Task.id == task_id))
        ended = status is None or TaskStatus(status) in TERMINAL
        return _page(s, task_id, after, limit), ended


async def follow(
    db: Database, task_id: str, after: int, *, poll_s: float, timeout_s: float, limit: int = 500
) -> AsyncIterator[bytes]:
    """Yield new output as it arrives; stop once the task has ended and nothing is left,
    or after ``timeout_s`` (counted in polls, so it holds under a fake clock too)."""
    rounds = max(1, math.ceil(timeout_s / poll_s)) if poll_s > 0 else 1
    for _ in range(rounds):
        page, ended = await asyncio.to_thread(_poll, db, task_id, after, limit)
        for chunk in page.chunks:
            yield chunk.text.encode("utf-8", "replace")
        after = page.next
        if len(page.chunks) == limit:
            continue  # more is waiting: read on without sleeping
        if ended:
            return
        await asyncio.sleep(poll_s)
