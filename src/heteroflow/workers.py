"""``--workers N`` (issue 31): N processes on one port, and the parent that supervises
them — ``heteroflow gateway`` (each worker a whole gateway) and ``heteroflow server``
(each worker a whole server instance) share it.

Pre-fork, not SO_REUSEPORT. The parent binds the listening socket once and forks the
workers, which inherit it: one accept queue that every worker takes connections from.

* A graceful restart drops nothing. With SO_REUSEPORT each worker's socket has its own
  queue, and the connections the kernel already put in the queue of a worker that stops
  are reset when it closes its socket. Here the parent holds the socket all along: a
  stopping worker only stops accepting, and whatever is queued is taken by another.
* The parent restarts a dead worker into the same socket; nothing is rebound.
* The cost is accept balance: every idle worker is woken for a new connection and the
  first to call accept() wins. The balance is measured by ``bench/gateway_workers.py``
  (connections and requests per worker, from the ``x-heteroflow-worker`` header).

The parent runs no event loop and no threads. It blocks SIGCHLD, SIGTERM, SIGINT and
SIGHUP and takes them with ``sigtimedwait``:

* SIGCHLD, a worker died: ``on_dead(column)`` runs (the gateway zeroes its column of the
  shared in-flight table) and a new worker is forked in its place (one second later if
  it lived less than two);
* SIGTERM / SIGINT: forwarded (as SIGTERM) to every worker, each of which stops
  accepting and finishes its requests in flight (``stop_accepting``, then the process's
  own stop); the parent exits when the last one has. A second one kills the workers
  (SIGKILL);
* SIGHUP, a graceful restart: ``check`` runs first (a gateway's routing file that no
  longer loads keeps the old workers, said in one line); then N new workers start, and
  once each has said it is ready (``say_ready``) — or after ``ready_timeout_s`` — the
  old ones are stopped as by SIGTERM.

A worker says it is ready by writing its pid to a pipe the parent reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGNALS = {signal.SIGCHLD, signal.SIGHUP, *STOP_SIGNALS}
_QUICK_DEATH_S = 2.0  # a worker that lived less is restarted after RESTART_DELAY_S
RESTART_DELAY_S = 1.0
_PR_SET_PDEATHSIG = 1

# -- what a worker does (the same in a gateway's and a server's) ------------------------
WORKER_HEADER = "x-heteroflow-worker"  # on every answer of a worker: its pid
# A stopping worker stops accepting this long before uvicorn's shutdown, which closes
# every connection without a request under way: one accepted a moment before, its
# request not read yet, would be closed unanswered (measured in a SIGHUP under load).
# Other workers take what is queued on the shared socket meanwhile.
STOP_ACCEPT_GRACE_S = 0.5
# asyncio accepts up to this many connections per wake-up of a worker (its default: the
# listen backlog, 2,048). A burst of new connections then spreads over the workers
# instead of landing on the first one awake (bench/gateway_workers.py, 32 new keep-alive
# connections at once: 100/0 over 2 workers with the default, 50/50 with 1); the other
# workers are woken for each connection anyway.
ACCEPT_BATCH = 1

# child(column, ready_fd) -> exit status, run in the forked worker. ``column % workers``
# is the worker's slot: a replacement (after a death, or in a restart's new generation)
# takes the slot of the one it replaces, so a role read from the slot stays one process.
Child = Callable[[int, int], int]


@dataclass
class _Worker:
    pid: int
    column: int
    generation: int
    started: float
    ready: bool = False


class Supervisor:
    """Forks ``workers`` children running ``child`` and keeps them running (see above).

    ``columns`` worker slots exist (2 x workers: an old and a new generation side by side
    during a restart); ``on_dead(column)`` runs in the parent when a worker's column is
    free again (the shared in-flight table zeroes it); ``on_stop`` when a stop begins
    (the parent closes its copy of the listening socket: once the workers have closed
    theirs, a new connection is refused at once instead of waiting in the queue for
    nobody).
    """

    def __init__(
        self,
        workers: int,
        child: Child,
        *,
        on_dead: Callable[[int], None] = lambda column: None,
        check: Callable[[], str | None] = lambda: None,
        on_stop: Callable[[], None] = lambda: None,
        ready_timeout_s: float = 30.0,
        name: str = "gateway",
    ) -> None:
        self.name = name  # the process's name in the parent's lines ("gateway: ...")
        self.workers = workers
        self.columns = 2 * workers
        self._child = child
        self._on_dead = on_dead
        self._check = check
        self._on_stop = on_stop
        self._ready_timeout_s = ready_timeout_s
        self._live: dict[int, _Worker] = {}
        self._generation = 0
        self._stopping = False
        self._pending: list[tuple[float, int]] = []  # (when, slot) of the next forks
        self._restart_started: float | None = None
        self._ready_r = -1
        self._ready_w = -1
        self._buf = b""
        self._child_mask: set[signal.Signals] = set()  # the mask the workers run with

    # -- the parent ---------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] = lambda: None) -> int:
        """Fork the workers; ``on_ready`` once they are all ready (or the wait is over);
        supervise until stopped. Returns 0 after a graceful stop."""
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        self._child_mask = {signal.Signals(s) for s in old_mask}
        self._ready_r, self._ready_w = os.pipe()
        os.set_blocking(self._ready_r, False)
        try:
            for slot in range(self.workers):
                self._spawn(slot)
            announced = False
            started = time.monotonic()
            while not (self._stopping and not self._live):
                info = signal.sigtimedwait(_SIGNALS, 0.25)
                if info is not None:
                    self._on_signal(info.si_signo)
                self._reap()
                self._read_ready()
                now = time.monotonic()
                if not announced and (
                    self._current_ready() >= self.workers or now - started > self._ready_timeout_s
                ):
                    announced = True
                    on_ready()
                self._finish_restart(now)
                while self._pending and self._pending[0][0] <= now and not self._stopping:
                    self._spawn(self._pending.pop(0)[1])
            return 0
        finally:
            os.close(self._ready_r)
            os.close(self._ready_w)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    @property
    def pids(self) -> list[int]:
        return sorted(self._live)

    def _on_signal(self, signo: int) -> None:
        if signo in STOP_SIGNALS:
            if self._stopping:  # the second one: no more waiting
                self._signal_all(signal.SIGKILL)
                return
            self._stopping = True
            self._pending.clear()
            self._signal_all(signal.SIGTERM)
            self._on_stop()
        elif signo == signal.SIGHUP and not self._stopping:
            self._begin_restart()

    def _begin_restart(self) -> None:
        if self._restart_started is not None:
            print(f"{self.name}: a restart is already under way", file=sys.stderr, flush=True)
            return
        problem = self._check()
        if problem is not None:
            print(
                f"{self.name}: restart refused, the old workers go on: {problem}",
                file=sys.stderr,
                flush=True,
            )
            return
        self._generation += 1
        self._restart_started = time.monotonic()
        for slot in range(self.workers):
            self._spawn(slot)

    def _finish_restart(self, now: float) -> None:
        """Stop the old generation once the new one is ready (or the wait is over)."""
        started = self._restart_started
        if started is None:
            return
        if self._current_ready() < self.workers and now - started <= self._ready_timeout_s:
            return
        for w in self._live.values():
            if w.generation < self._generation:
                _kill(w.pid, signal.SIGTERM)
        self._restart_started = None

    def _current_ready(self) -> int:
        gen = self._generation
        return sum(1 for w in self._live.values() if w.generation == gen and w.ready)

    def _signal_all(self, sig: int) -> None:
        for pid in list(self._live):
            _kill(pid, sig)

    def _reap(self) -> None:
        while self._live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self._live.pop(pid, None)
            if w is None:
                continue
            self._on_dead(w.column)
            if self._stopping or w.generation < self._generation:
                continue  # stopped on purpose
            lived = time.monotonic() - w.started
            print(
                f"{self.name}: worker {pid} {_how(status)} after {lived:.1f} s; starting another",
                file=sys.stderr,
                flush=True,
            )
            delay = RESTART_DELAY_S if lived < _QUICK_DEATH_S else 0.0
            self._pending.append((time.monotonic() + delay, w.column % self.workers))
            self._pending.sort()

    def _read_ready(self) -> None:
        try:
            data = os.read(self._ready_r, 4096)
        except BlockingIOError:
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                w = self._live.get(int(line))
                if w is not None:
                    w.ready = True

    def _spawn(self, slot: int) -> None:
        """Fork the worker of ``slot`` into whichever of the slot's two columns is free."""
        used = {w.column for w in self._live.values()}
        column = next((c for c in (slot, slot + self.workers) if c not in used), None)
        if column is None:  # old and new generations fill both: wait for one
            self._pending.append((time.monotonic() + 0.25, slot))
            self._pending.sort()
            return
        sys.stdout.flush()  # nothing buffered here is written twice
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.close(self._ready_r)
                _die_with(parent)
                for sig in _SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, self._child_mask)
                code = self._child(column, self._ready_w)
            except BaseException:  # the worker's last word, then exit
                logger.exception("%s worker failed", self.name)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self._live[pid] = _Worker(pid, column, self._generation, time.monotonic())


def redis_problem(workers: int, redis_url: str) -> str | None:
    """The rule of both ``--workers`` flags (gateway and server): more than one process
    needs Redis, where the gateway's rate limits, quotas and idempotency keys are exact
    across processes (None: the rule holds)."""
    if workers <= 1 or redis_url:
        return None
    return (
        f"--workers {workers} needs HETEROFLOW_REDIS_URL: the gateway's rate limits, quotas "
        "and idempotency keys are exact across workers only through Redis (else --workers 1)"
    )


def say_ready(ready_fd: int) -> None:
    """In a worker: tell the parent this worker serves (with routes)."""
    with contextlib.suppress(OSError):
        os.write(ready_fd, b"%d\n" % os.getpid())


def worker_headers() -> list[tuple[str, str]]:
    """The headers uvicorn adds to every answer of this worker (its pid)."""
    return [(WORKER_HEADER, str(os.getpid()))]


async def say_ready_when(
    server: Any, ready_fd: int, wait_s: float, also: Callable[[], bool] = lambda: True
) -> None:
    """Say ready once uvicorn ``server`` serves and ``also()`` holds — or after
    ``wait_s`` without: a restart stops the old workers only then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not (server.started and also()):
        if loop.time() > deadline:
            break
        await asyncio.sleep(0.05)
    say_ready(ready_fd)


async def stop_accepting(server: Any) -> None:
    """A worker's graceful stop, first step (see ``STOP_ACCEPT_GRACE_S``): uvicorn
    ``server`` closes its listeners, and what is queued on the shared socket goes to
    the other workers; the caller then stops uvicorn (requests in flight finish)."""
    for listener in getattr(server, "servers", ()):
        listener.close()
    await asyncio.sleep(STOP_ACCEPT_GRACE_S)


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0))


def _die_with(parent: int) -> None:
    """A worker whose parent is killed (SIGKILL: no forwarding) is sent SIGTERM, so that
    no orphan keeps serving the port unsupervised (Linux' PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with {os.waitstatus_to_exitcode(status)}"


class ProcessFiles:
    """What each worker of one parent counted, for the one that answers a scrape: a file
    per process (named by its pid) in a private directory the parent made, written whole
    (by rename: a reader never sees half) once a second and when the process stops, as
    Prometheus's client's multiprocess mode keeps a file per process. ``others`` reads
    the other processes' last states, each with whether that process still lives (a
    counter of one that exited stays in a sum — the total never goes down — while its
    gauges do not)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._own = directory / f"{os.getpid()}.metrics"

    def write(self, state: object) -> None:
        tmp = self._own.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(state))
        tmp.replace(self._own)

    async def run(
        self, stop: asyncio.Event, state: Callable[[], object], interval_s: float = 1.0
    ) -> None:
        """Write ``state()`` every ``interval_s`` until ``stop``, and once more then."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            with contextlib.suppress(OSError):
                self.write(state())

    def others(self) -> list[tuple[Any, bool]]:
        """(state, alive) of every other process that wrote one."""
        out: list[tuple[Any, bool]] = []
        for path in self._dir.glob("*.metrics"):
            if path == self._own:
                continue
            try:
                state = pickle.loads(path.read_bytes())  # noqa: S301 - our own workers' files
            except (OSError, pickle.UnpicklingError, EOFError):
                continue
            out.append((state, _alive(int(path.stem))))
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
