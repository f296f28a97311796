"""``heteroflow up`` as a child process, and the few calls a benchmark makes against it
(bench/lifecycle.py, bench/cold_start.py): start and stop it, log in, follow a service,
time the first byte of a streamed chat answer through the gateway."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import httpx

ADMIN_PASSWORD = "bench-up-stack-admin-password"  # noqa: S105 - a throw-away stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, fn: Callable[[], Any], timeout_s: float, every_s: float = 0.05) -> Any:
    """Call ``fn`` until it returns something true (HTTP and OS errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s (last: {last!r})")


class Up:
    """``heteroflow up --demo none`` as a child process (``env``: extra variables)."""

    def __init__(
        self, data_dir: Path, port: int, pool: tuple[int, int],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = port
        self.pool = pool
        self.env = dict(env or {})
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / "up.log"

    def start(self) -> float:
        """Start it; seconds until /healthz answers."""
        started = time.monotonic()
        env = {**os.environ, "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD, **self.env}
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "heteroflow.cli", "up",
                "--demo", "none",
                "--port", str(self.port),
                "--port-range", f"{self.pool[0]}-{self.pool[1]}",
                "--data-dir", str(self.data_dir),
                "--threads", "1",
            ],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        wait_for(
            "up /healthz",
            lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200,
            60,
        )
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class Api:
    """The management API as the admin."""

    def __init__(self, url: str) -> None:
        self.url = url
        r = httpx.post(
            url + "/api/v1/auth/login",
            json={"username": "admin", "password": ADMIN_PASSWORD},
            timeout=30,
        )
        r.raise_for_status()
        self.headers = {"Authorization": f"Bearer {r.json()['access_token']}"}

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=self.headers, timeout=30, **kw)

    def group(self, group_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/api/v1/task-groups/{group_id}").json())

    def events(self, group_id: str) -> list[dict[str, Any]]:
        return list(self.call("GET", f"/api/v1/task-groups/{group_id}/events").json())


def listening_url(
    out: IO[str], what: str, timeout_s: float = 60.0, pattern: str = r"listening on (http://\S+)"
) -> str:
    """The URL a child process prints (``pattern``'s group 1) on ``out``, within
    ``timeout_s``. The rest of ``out`` is read on and dropped by a daemon thread, so a
    child that keeps printing never blocks on a full pipe."""
    found: list[str] = []
    wanted = re.compile(pattern)

    def read() -> None:
        for line in out:
            if not found:
                m = wanted.search(line)
                if m:
                    found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    return str(wait_for(what, lambda: found and found[0], timeout_s))


@contextlib.contextmanager
def steady_load(call: Callable[[], int], threads: int) -> Iterator[list[int]]:
    """``threads`` threads calling ``call`` (an HTTP status) until the block ends; yields
    the statuses as they come, 0 for a connection dropped (what a restart must not do)."""
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        while not stop.is_set():
            try:
                statuses.append(call())
            except httpx.TransportError:
                statuses.append(0)

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(threads)]
    for t in loaders:
        t.start()
    try:
        yield statuses
    finally:
        stop.set()
        for t in loaders:
            t.join(60)


def first_byte_s(url: str, key: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> float:
    """Seconds from sending ``body`` as a streamed chat request to the first byte of a 2xx
    answer (raises on any other answer)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.monotonic()
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=timeout_s,
    ) as r:
        for chunk in r.iter_raw():
            if chunk:
                took = time.monotonic() - start
                if r.status_code >= 300:
                    raise RuntimeError(f"HTTP {r.status_code}: {chunk[:300]!r}")
                return took
    raise RuntimeError(f"HTTP {r.status_code} with an empty body")
