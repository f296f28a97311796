"""``heteroflow server --workers N`` (issue 31, item 5): N server processes on one port.

As real processes on PostgreSQL and Redis: both workers answer on the one port (the
``x-heteroflow-worker`` header names the pid), each is an instance of its own in
``GET /servers``, a killed worker is replaced, and SIGTERM stops the parent and its
workers. Refused in one line, exit 2, on SQLite and without Redis. In process: a worker
other than the primary leaves out the loops one per host suffices for (the scheduler).

Generous timeouts and no timing asserts: the machine may be a loaded 2-core box.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from heteroflow.server import ServerApp
from heteroflow.serving import bind
from heteroflow.settings import ServerSettings
from heteroflow.workers import WORKER_HEADER

from .conftest import REDIS_URL

ADMIN_PASSWORD = "workers-admin-password"


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout:g} s"
        time.sleep(0.05)


def _listening_url(out: IO[str], timeout: float = 90.0) -> str:
    found: list[str] = []

    def read() -> None:
        for line in out:
            m = re.search(r"listening on (http://\S+) \(2 workers\)", line)
            if m:
                found.append(m.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, "the server did not say it listens with 2 workers"
    return found[0]


def _children(pid: int) -> set[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(p) for p in text.split()}


def _env(tmp: Path, **over: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    env.update(
        HETEROFLOW_DATA_DIR=str(tmp / "data"),
        HETEROFLOW_ADMIN_PASSWORD=ADMIN_PASSWORD,
        HETEROFLOW_NODE_TOKEN="workers-node-token",
        HETEROFLOW_GATEWAY_TOKEN="workers-gateway-token",
        **over,
    )
    return env


def _server(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "heteroflow.cli", "server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.fixture
def two_workers(pg_empty_url: str, tmp_path: Path, prefix: str) -> Iterator[tuple[int, str]]:
    """(the parent's pid, its URL) of ``heteroflow server --workers 2``."""
    env = _env(
        tmp_path,
        HETEROFLOW_DATABASE_URL=pg_empty_url,
        HETEROFLOW_REDIS_URL=REDIS_URL,
        HETEROFLOW_REDIS_KEY_PREFIX=prefix,
    )
    proc = _server("--workers", "2", env=env)
    assert proc.stdout is not None
    try:
        yield proc.pid, _listening_url(proc.stdout)
    finally:
        children = _children(proc.pid)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()  # its workers get SIGTERM from the kernel (PR_SET_PDEATHSIG)
                proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _answering(url: str, tries: int = 40) -> set[int]:
    """The workers that answered ``tries`` requests, each on a new connection (the
    kernel hands it to whichever worker accepts)."""
    seen: set[int] = set()
    for _ in range(tries):
        r = httpx.get(f"{url}/healthz", timeout=30)
        assert r.status_code == 200, r.text
        seen.add(int(r.headers[WORKER_HEADER]))
    return seen


def test_two_workers_answer_on_one_port_and_a_killed_one_is_replaced(
    two_workers: tuple[int, str],
) -> None:
    parent, url = two_workers
    _wait_for(lambda: len(_children(parent)) == 2, what="two workers")
    workers = _children(parent)
    seen: set[int] = set()
    _wait_for(lambda: seen.update(_answering(url, 10)) or seen == workers, 60, "both answer")

    # each worker is an instance of its own on the one database
    token = httpx.post(
        f"{url}/api/v1/auth/login",
        json={"username": "admin", "password": ADMIN_PASSWORD},
        timeout=30,
    ).json()["access_token"]

    def instances() -> set[int]:
        r = httpx.get(
            f"{url}/api/v1/servers", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        assert r.status_code == 200, r.text
        return {i["pid"] for i in r.json()["instances"]}

    _wait_for(lambda: workers <= instances(), what="both workers in GET /servers")

    killed = min(workers)
    os.kill(killed, signal.SIGKILL)
    _wait_for(
        lambda: len(_children(parent) - workers) == 1, what="a new worker in the killed one's place"
    )
    (new,) = _children(parent) - workers
    assert _children(parent) == workers - {killed} | {new}
    seen = set()
    _wait_for(lambda: seen.update(_answering(url, 10)) or new in seen, 60, "the new one answers")
    assert killed not in seen


def test_sigterm_stops_the_parent_and_every_worker(two_workers: tuple[int, str]) -> None:
    parent, url = two_workers
    _wait_for(lambda: len(_children(parent)) == 2, what="two workers")
    workers = _children(parent)
    os.kill(parent, signal.SIGTERM)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie until reaped: its state says so
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        return True

    _wait_for(lambda: all(gone(p) for p in workers), 60, "the workers stopped")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=5)


@pytest.mark.parametrize(
    ("over", "needs"),
    [
        ({}, "needs PostgreSQL (HETEROFLOW_DATABASE_URL)"),  # the data directory's SQLite
        ({"HETEROFLOW_DATABASE_URL": "sqlite:////tmp/x.db"}, "needs PostgreSQL"),
        (
            {"HETEROFLOW_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"},
            "needs HETEROFLOW_REDIS_URL",
        ),
    ],
)
def test_more_than_one_worker_is_refused_in_one_line(
    tmp_path: Path, over: dict[str, str], needs: str
) -> None:
    proc = _server("--workers", "2", env=_env(tmp_path, **over))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert out.strip().splitlines() == [
        next(line for line in out.splitlines() if "--workers 2" in line)
    ]
    assert needs in out and "--workers 1" in out


@pytest.mark.parametrize("primary", [True, False])
def test_only_the_primary_worker_runs_the_per_host_loops(
    tmp_path: Path, primary: bool
) -> None:
    settings = ServerSettings(
        data_dir=tmp_path / "data",
        admin_password=ADMIN_PASSWORD,
        scheduler_interval_s=0.05,
        snapshot_interval_s=0.05,
    )
    app = ServerApp(settings, per_host_loops=primary)
    rounds: dict[str, int] = {"scheduler": 0, "snapshot": 0}
    for c in (app.scheduler, app.publisher):
        original = c.reconcile_once

        def counted(now: object, name: str = c.name, original: object = original) -> None:
            rounds[name] += 1
            original(now)  # type: ignore[operator]

        c.reconcile_once = counted  # type: ignore[method-assign]

    async def main() -> None:
        stop = asyncio.Event()
        serving = asyncio.create_task(app.serve(stop, bind("127.0.0.1", 0)))
        deadline = asyncio.get_running_loop().time() + 30
        while rounds["snapshot"] < 5 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await serving

    asyncio.run(main())
    assert rounds["snapshot"] >= 5  # every worker publishes its gateway's snapshot
    assert (rounds["scheduler"] > 0) is primary
