"""Shipping task output to the server (FEATURES C6), incrementally, once per round.

Each round, for each local task, the shipper asks a runtime-provided
``source(task_id, since) -> (text, next_since)`` for what was written after ``since``
(the Docker runtime's ``logs_since``, which reads at most 2000 lines; ``file_source``
below for the process runtime's log files) and posts it in pieces of at most
``max_bytes`` (the server's 1 MiB per call), cut on UTF-8 character boundaries.

Nothing is lost and nothing is sent twice: text that was read but not yet delivered
stays in a per-task outbox, and the source is not read again for that task until the
outbox is empty — so a failed post is retried next round from the same piece, and the
position (``next_since``) only moves on together with text held for delivery. A 404 or
409 answer means the server no longer takes output for that task: it is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from heteroflow.agent.client import ServerError

log = logging.getLogger(__name__)

LogSource = Callable[[str, str], tuple[str, str]]
MAX_POST_BYTES = 1024 * 1024


class LogClient(Protocol):
    async def post_logs(self, task_id: str, text: str) -> None: ...


def split_utf8(text: str, max_bytes: int) -> list[str]:
    """Pieces of ``text`` whose UTF-8 encodings are at most ``max_bytes`` each."""
    data = text.encode("utf-8", "replace")
    pieces: list[str] = []
    start = 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        while end < len(data) and end > start and (data[end] & 0xC0) == 0x80:
            end -= 1  # do not cut inside a character
        pieces.append(data[start:end].decode("utf-8", "replace"))
        start = end
    return pieces


class LogShipper:
    def __init__(
        self, client: LogClient, source: LogSource, max_bytes: int = MAX_POST_BYTES
    ) -> None:
        self.client = client
        self.source = source
        self.max_bytes = max_bytes
        self._since: dict[str, str] = {}
        self._outbox: dict[str, list[str]] = {}
        # The aux loop and a stopping task may ship at the same time: one round at a
        # time, or two rounds would pop the same outbox piece (and read twice).
        self._lock = asyncio.Lock()

    def since(self, task_id: str) -> str:
        return self._since.get(task_id, "")

    def pending(self, task_id: str) -> int:
        """Pieces read but not yet delivered."""
        return len(self._outbox.get(task_id, ()))

    def forget(self, task_id: str) -> None:
        """Drop a task's position and undelivered text (after its final round)."""
        self._since.pop(task_id, None)
        self._outbox.pop(task_id, None)

    async def ship_once(self, task_ids: Iterable[str]) -> int:
        """One round over ``task_ids``; returns how many pieces were delivered."""
        async with self._lock:
            return await self._ship(list(task_ids))

    async def _ship(self, task_ids: list[str]) -> int:
        sent = 0
        for task_id in task_ids:
            if not self._outbox.get(task_id):
                try:
                    text, nxt = await asyncio.to_thread(self.source, task_id, self.since(task_id))
                except Exception as exc:
                    log.warning("reading output of %s failed: %s", task_id, exc)
                    continue
                self._outbox[task_id] = split_utf8(text, self.max_bytes) if text else []
                self._since[task_id] = nxt
            sent += await self._deliver(task_id)
        return sent

    async def _deliver(self, task_id: str) -> int:
        box = self._outbox.get(task_id, [])
        sent = 0
        while box:
            try:
                await self.client.post_logs(task_id, box[0])
            except ServerError as exc:
                if exc.status in (404, 409):
                    log.info("output of %s no longer taken: %s", task_id, exc)
                    box.clear()
                    break
                log.warning("shipping output of %s failed: %s", task_id, exc)
                break
            except Exception as exc:  # network: keep it for the next round
                log.warning("shipping output of %s failed: %s", task_id, exc)
                break
            box.pop(0)
            sent += 1
        return sent


def file_source(
    path_for: Callable[[str], Path | None], max_bytes: int = MAX_POST_BYTES
) -> LogSource:
    """A source over plain log files: ``since`` is a byte offset ("" = the last
    ``max_bytes`` of the file). A file that shrank was replaced: read it from 0.
    Reads end after the last complete line when there is one, so lines are not split."""

    def read(task_id: str, since: str) -> tuple[str, str]:
        path = path_for(task_id)
        if path is None or not path.exists():
            return "", since
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = int(since) if since.isdigit() else max(0, size - max_bytes)
            if start > size:
                start = 0
            f.seek(start)
            data = f.read(max_bytes)
        if not since.isdigit():  # a tail may begin inside a character: skip to the next
            skip = next((i for i, b in enumerate(data[:4]) if b & 0xC0 != 0x80), 0)
            data, start = data[skip:], start + skip
        # a partial last line waits for its end; without any newline, ship whole chars
        nl = data.rfind(b"\n")
        data = data[: nl + 1] if nl >= 0 else _whole_chars(data)
        return data.decode("utf-8", "replace"), str(start + len(data))

    return read


def _whole_chars(data: bytes) -> bytes:
    """``data`` without a UTF-8 character cut off at its end."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for the lead
        need = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        return data if need <= back else data[:-back]
    return data
