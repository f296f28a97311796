"""One running HeteroFlow per data directory (issue 33): an OS lock on ``DATA_DIR/instance.lock``.

A second ``up`` (or ``server`` on the data directory's own SQLite database) on the same
data directory, whatever its ``--port``, would share the first one's database, demo
service, demo key, agent work directory and CLI login: it used to take them over and
fail every service of the first within seconds. ``acquire`` takes an exclusive
``flock`` on the lock file before anything else is touched; the file holds who holds
it (command, pid, URL) for the refusal's one line. The kernel drops the lock when the
process ends, however it ends, so a crash never leaves a stale lock behind: the file
that stays is only read while someone holds the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from heteroflow.cmd.errors import EXIT_UNREACHABLE, CliError

LOCK_FILE = "instance.lock"
# the same exit code as a busy port: the process cannot start, nothing was changed
EXIT_IN_USE = EXIT_UNREACHABLE


@dataclass(slots=True)
class InstanceLock:
    """Held while this object's file stays open (for the life of the process)."""

    path: Path
    fd: int
    command: str

    def describe(self, url: str) -> None:
        """Write who holds it (pid, URL) for a refused second start to name."""
        record = json.dumps({"command": self.command, "pid": os.getpid(), "url": url})
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (record + "\n").encode(), 0)

    def release(self) -> None:
        os.close(self.fd)  # closing the last descriptor drops the flock


def holder(path: Path) -> str:
    """``up, pid 1234, http://127.0.0.1:3333`` from the lock file (what can be read)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return "pid unknown"
    if not isinstance(record, dict):
        return "pid unknown"
    parts = [str(record.get("command") or "heteroflow"), f"pid {record.get('pid', '?')}"]
    if record.get("url"):
        parts.append(str(record["url"]))
    return ", ".join(parts)


def acquire(data_dir: Path, command: str, url: str) -> InstanceLock:
    """The data directory's lock, or a ``CliError`` naming the running instance."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        # no O_TRUNC: the holder's record must survive a refused opener
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CliError(
            f"cannot use the data directory {data_dir}: {exc.strerror or exc}", EXIT_IN_USE
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise CliError(
            f"another HeteroFlow already runs on the data directory {data_dir} "
            f"({holder(path)}); stop it first, or give this one its own --data-dir",
            EXIT_IN_USE,
        ) from None
    lock = InstanceLock(path, fd, command)
    lock.describe(url)
    return lock
