"""Plain-process runtime: each engine is a child process in its own session.

Children get ``PR_SET_PDEATHSIG`` (Linux) so that an agent killed hard does not leave
orphan engines; a clean stop sends SIGTERM to the whole process group and SIGKILL after
the timeout. Output goes to a per-task log file under the agent's work dir.

The death signal is a SIGTERM, and nothing follows it up: an engine that does not end on
it (stuck in a driver call, a handler that hangs — the llama.cpp launcher's once did)
outlives its agent, holding its port and its card. So each engine's pid and start time
are written under ``run/`` in the work dir, and a runtime made on that work dir (the
agent, started again) kills what is left of the last one's engines — each whole process
group, SIGKILL: nobody is left to answer — before it starts any. The start time tells an
engine from an unrelated process that got its pid since.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from heteroflow.agent.runtime.protocol import LaunchFailed, LaunchSpec, PortInUse
from heteroflow.private_files import private_dir

log = logging.getLogger(__name__)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on the port now.

    SO_REUSEADDR as engines set it: connections in TIME_WAIT from a stopped engine do
    not block a new listener, so they must not count as "in use" either.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22); None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


class ProcessRuntime:
    name = "process"

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, Path] = {}
        self._run = work_dir / "run"  # task id -> "pid start-ticks" of its engine
        self.orphans_killed = self._kill_orphans()

    def _kill_orphans(self) -> list[str]:
        """Kill the engines a previous runtime on this work dir left running (see the
        module doc); the tasks whose engines it killed."""
        if not self._run.is_dir():
            return []
        killed = []
        for record in self._run.iterdir():
            try:
                pid, ticks = (int(x) for x in record.read_text().split())
            except (OSError, ValueError):
                pid, ticks = 0, -1
            if pid > 0 and _start_ticks(pid) == ticks:
                log.warning(
                    "task %s: its engine (pid %d) outlived the last agent on this node; "
                    "killing it", record.name, pid,
                )
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # its own session: the whole group
                killed.append(record.name)
            record.unlink(missing_ok=True)
        return killed

    def _record(self, task_id: str, pid: int) -> None:
        private_dir(self._run)
        ticks = _start_ticks(pid)
        if ticks is not None:
            (self._run / task_id).write_text(f"{pid} {ticks}\n")

    def start(self, spec: LaunchSpec) -> None:
        if spec.task_id in self._procs:
            raise LaunchFailed(f"task {spec.task_id} is already running")
        for port in spec.host_ports:
            if not port_free(port, spec.host):
                raise PortInUse(f"host port {port} is already in use", (port,))
        log_path = spec.log_path or self.work_dir / "logs" / f"{spec.task_id}.log"
        private_dir(log_path.parent)
        env = dict(spec.env)  # the whole environment: never the agent's own (secrets)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            try:
                proc = subprocess.Popen(
                    list(spec.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.work_dir,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise LaunchFailed(f"cannot start {spec.argv[0]!r}: {exc.strerror}") from exc
        self._procs[spec.task_id] = proc
        self._record(spec.task_id, proc.pid)
        self._logs[spec.task_id] = log_path
        log.info("started task %s as pid %d", spec.task_id, proc.pid)

    def exit_code(self, task_id: str) -> int | None:
        proc = self._procs.get(task_id)
        if proc is None:
            return -1
        return proc.poll()

    def stop(self, task_id: str, timeout_s: float) -> None:
        proc = self._procs.get(task_id)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            time.sleep(0.05)
        log.warning("task %s ignored SIGTERM for %.0f s; killing", task_id, timeout_s)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(5)

    def halt(self, task_id: str, timeout_s: float) -> None:
        """Sleep (F1): the process stops like any stop and is forgotten; its log file
        stays, and a wake launches the same argv again."""
        self.stop(task_id, timeout_s)
        self.forget(task_id)

    def running(self) -> list[str]:
        return [t for t, p in self._procs.items() if p.poll() is None]

    def managed(self) -> dict[str, str]:
        return {t: ("running" if p.poll() is None else "exited") for t, p in self._procs.items()}

    def remove(self, task_id: str) -> None:
        self.stop(task_id, timeout_s=2.0)
        self.forget(task_id)

    def forget(self, task_id: str) -> None:
        self._procs.pop(task_id, None)
        (self._run / task_id).unlink(missing_ok=True)

    def pid(self, task_id: str) -> int | None:
        proc = self._procs.get(task_id)
        return None if proc is None else proc.pid

    def log_tail(self, task_id: str, lines: int) -> str:
        path = self._logs.get(task_id)
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
        return "\n".join(data.splitlines()[-lines:])
