"""``heteroflow server --workers N`` (issue 31, item 5): N server processes on one port.

As real processes on PostgreSQL and Redis: both workers answer on the one port (the
``x-heteroflow-worker`` header names the pid) and the third child, the controllers'
process, answers nothing; each is an instance of its own in ``GET /servers``, and the
leader is the controllers' process; a killed worker is replaced, and SIGTERM answers the
requests in flight and stops the parent and its children. Refused in one line, exit 2,
on SQLite and without Redis. In process: which loops each role runs.

Generous timeouts and no timing asserts: the machine may be a loaded 2-core box.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.cmd.server import database_problem
from heteroflow.server import Role, ServerApp
from heteroflow.serving import bind
from heteroflow.settings import ServerSettings
from heteroflow.testing.up_stack import listening_url, steady_load
from heteroflow.workers import WORKER_HEADER

from .conftest import REDIS_URL
from .test_agent_tls import make_ca, make_server_cert

ADMIN_PASSWORD = "workers-admin-password"


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout:g} s"
        time.sleep(0.05)


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
        yield proc.pid, listening_url(
            proc.stdout, "the server, with 2 workers", 90, r"listening on (http://\S+) \(2 workers"
        )
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop the parent (SIGTERM, then SIGKILL) and whatever of its children is left."""
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
    _wait_for(lambda: len(_children(parent)) == 3, what="two workers and the controllers")
    children = _children(parent)
    seen: set[int] = set()

    def answered(n: int) -> bool:
        seen.update(_answering(url, 10))
        return len(seen) >= n

    _wait_for(lambda: answered(2), 60, "both answer")
    workers = set(seen)
    (controllers,) = children - workers
    assert not seen - children

    # each worker is an instance of its own on the one database
    token = httpx.post(
        f"{url}/api/v1/auth/login",
        json={"username": "admin", "password": ADMIN_PASSWORD},
        timeout=30,
    ).json()["access_token"]

    def servers() -> dict[str, Any]:
        r = httpx.get(
            f"{url}/api/v1/servers", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def settled() -> bool:
        body = servers()
        pids = {i["id"]: i["pid"] for i in body["instances"]}
        return children <= set(pids.values()) and pids.get(body["leader"]) == controllers

    _wait_for(settled, 60, "every child in GET /servers, the controllers' process leading")

    killed = min(workers)
    os.kill(killed, signal.SIGKILL)
    _wait_for(
        lambda: len(_children(parent) - children) == 1,
        what="a new worker in the killed one's place",
    )
    (new,) = _children(parent) - children
    assert _children(parent) == children - {killed} | {new}
    seen.clear()
    _wait_for(lambda: answered(1) and new in seen, 60, "the new one answers")
    assert killed not in seen


def test_sighup_replaces_every_process_without_a_failed_request_and_roles_survive(
    two_workers: tuple[int, str],
) -> None:
    """SIGHUP: a new generation (two workers and a controllers' process), then the old one
    stops, with requests arriving all along; a worker of the new generation that dies is
    replaced by a worker — not by a second controllers' process (the role goes with the
    slot a process fills, not with the first free column)."""
    parent, url = two_workers
    _wait_for(lambda: len(_children(parent)) == 3, what="two workers and the controllers")
    before = _children(parent)

    def healthz() -> int:  # a new connection each time: whichever worker accepts it
        return httpx.get(f"{url}/healthz", timeout=30).status_code

    with steady_load(healthz, 3) as statuses:
        _wait_for(lambda: len(statuses) > 10, what="load running")
        os.kill(parent, signal.SIGHUP)
        _wait_for(lambda: not _children(parent) & before, 90, "the old generation gone")
        _wait_for(lambda: len(_children(parent)) == 3, 60, "a whole new generation")
        n = len(statuses)
        _wait_for(lambda: len(statuses) > n + 10, what="load after the restart")
    assert statuses and set(statuses) == {200}, sorted(set(statuses))

    generation = _children(parent)
    seen: set[int] = set()

    def answered_by(wanted: set[int]) -> Callable[[], bool]:
        def check() -> bool:
            seen.update(_answering(url, 10))
            return seen >= wanted if wanted else len(seen) >= 2

        return check

    _wait_for(answered_by(set()), 60, "both new workers answer")
    workers = set(seen)
    assert workers <= generation and len(workers) == 2
    os.kill(min(workers), signal.SIGKILL)
    _wait_for(lambda: len(_children(parent) - generation) == 1, what="a replacement")
    (new,) = _children(parent) - generation
    seen.clear()
    # the replacement serves (a worker), and the other worker still does: had it become a
    # second controllers' process, only one process would answer
    _wait_for(answered_by({new, max(workers)}), 60, "the replacement and the other worker")


@pytest.mark.feature("P3")
def test_metrics_answer_for_every_process_whichever_worker_is_scraped(
    two_workers: tuple[int, str],
) -> None:
    """A scrape reaches one worker; it answers with every process's counts — the API
    requests the other worker served, and the scheduler's rounds, which run in the
    controllers' process that no request reaches."""
    parent, url = two_workers
    _wait_for(lambda: len(_children(parent)) == 3, what="two workers and the controllers")
    pids: set[int] = set()

    def scraped() -> dict[int, str]:
        out: dict[int, str] = {}
        for _ in range(20):
            r = httpx.get(f"{url}/metrics", timeout=30)
            assert r.status_code == 200
            out[int(r.headers[WORKER_HEADER])] = r.text
        pids.update(out)
        return out

    rounds = re.compile(
        r'heteroflow_server_controller_rounds_total\{controller="scheduler"\} (\d+)'
    )
    healthz = re.compile(
        r'heteroflow_server_api_request_duration_seconds_count\{method="GET",'
        r'route="/healthz",code="2xx"\} (\d+)'
    )

    def summed() -> bool:
        texts = scraped()
        if len(texts) < 2:
            return False
        for text in texts.values():  # each worker's answer holds the scheduler's rounds
            m = rounds.search(text)
            if m is None or int(m[1]) < 1:
                return False
        return True

    _wait_for(summed, 60, "the scheduler's rounds on both workers' /metrics")
    for _ in range(30):  # spread over both workers
        assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200

    def counted() -> bool:
        for text in scraped().values():
            m = healthz.search(text)
            if m is None or int(m[1]) < 30:
                return False
        return True

    _wait_for(counted, 30, "every /healthz in the sum (each worker's file: once a second)")


def test_sigterm_answers_the_requests_in_flight_and_stops_every_worker(
    two_workers: tuple[int, str],
) -> None:
    parent, url = two_workers
    _wait_for(lambda: len(_children(parent)) == 3, what="two workers and the controllers")
    children = _children(parent)
    # keep-alive connections already accepted (a connection still in the queue when the
    # last worker stops accepting is the one thing a stop refuses), then a login on each
    # (its password hash: a request that takes a while; four, as a fifth login at once
    # would be throttled) with SIGTERM sent meanwhile
    clients = [httpx.Client(base_url=url, timeout=60) for _ in range(4)]
    for c in clients:
        assert c.get("/healthz").status_code == 200
    login = {"username": "admin", "password": ADMIN_PASSWORD}
    with ThreadPoolExecutor(len(clients)) as pool:
        answers = [pool.submit(c.post, "/api/v1/auth/login", json=login) for c in clients]
        time.sleep(0.05)
        os.kill(parent, signal.SIGTERM)
        codes = [f.result().status_code for f in answers]
    for c in clients:
        c.close()
    assert codes == [200] * len(clients)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie until reaped: its state says so
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        return True

    _wait_for(lambda: all(gone(p) for p in children), 60, "the children stopped")
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


@pytest.mark.parametrize(
    ("role", "runs"),
    [
        ("all", {"scheduler", "snapshot", "node-watch", "leader-election"}),
        ("controllers", {"scheduler", "node-watch", "leader-election"}),
        ("requests", {"snapshot", "leader-election"}),
    ],
)
def test_each_role_runs_its_loops_and_only_a_requests_worker_never_leads(
    tmp_path: Path, role: Role, runs: set[str]
) -> None:
    settings = ServerSettings(
        data_dir=tmp_path / "data",
        admin_password=ADMIN_PASSWORD,
        scheduler_interval_s=0.05,
        snapshot_interval_s=0.05,
        leader_renew_interval_s=0.05,
        leader_lease_ttl_s=1.0,
    )
    app = ServerApp(settings, role=role)
    watched = {"scheduler", "snapshot", "node-watch", "leader-election"}
    rounds = dict.fromkeys(watched, 0)
    for c in app.controllers:
        if c.name not in watched:
            continue
        original = c.reconcile_once

        def counted(now: object, name: str = c.name, original: object = original) -> None:
            rounds[name] += 1
            original(now)  # type: ignore[operator]

        c.reconcile_once = counted  # type: ignore[method-assign]

    async def main() -> bool:
        stop = asyncio.Event()
        sock = bind("127.0.0.1", 0)
        if role == "controllers":
            r, w = os.pipe()
            serving = asyncio.create_task(app.run_loops(stop, sock, w))
        else:
            serving = asyncio.create_task(app.serve(stop, sock))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while min(rounds[n] for n in runs) < 5 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        led = app.leadership.is_leader(app.clock.now())
        stop.set()
        await serving
        if role == "controllers":
            assert os.read(r, 64).strip() == str(os.getpid()).encode()  # said ready
            os.close(r)
            os.close(w)
        return led

    led = asyncio.run(main())
    assert {n for n, k in rounds.items() if k >= 5} == runs
    assert not {n for n, k in rounds.items() if k} - runs
    assert led is (role != "requests")  # alone on its database, it leads unless it never bids


def _printed(log: Path, pattern: str, timeout: float = 90.0) -> re.Match[str]:
    """The first match of ``pattern`` in what the server printed to ``log``."""
    found: list[re.Match[str]] = []

    def seen() -> bool:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            found.append(m)
        return m is not None

    _wait_for(seen, timeout, f"{pattern!r} printed")
    return found[0]


@pytest.mark.feature("P4")
def test_sighup_with_a_certificate_that_does_not_load_keeps_the_old_processes(
    pg_empty_url: str, tmp_path: Path, prefix: str
) -> None:
    """A SIGHUP is how a renewed certificate is taken; a new generation that cannot load
    it would never serve, and the old one would be stopped anyway once the wait ran out.
    The parent checks first (``cmd.server.restart_problem``: the TLS files as they are
    now, the database answering): refused in one line, the old processes go on serving;
    with a good certificate back, the next SIGHUP replaces them."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test's certificates")
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki, "ca")
    cert, key = make_server_cert(pki, "ca", "IP:127.0.0.1")
    env = _env(
        tmp_path,
        HETEROFLOW_DATABASE_URL=pg_empty_url,
        HETEROFLOW_REDIS_URL=REDIS_URL,
        HETEROFLOW_REDIS_KEY_PREFIX=prefix,
        HETEROFLOW_TLS_CERT_FILE=str(cert),
        HETEROFLOW_TLS_KEY_FILE=str(key),
    )
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "heteroflow.cli", "server", "--port", "0", "--workers", "2"],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
        )
    try:
        url = _printed(log, r"listening on (https://\S+) \(2 workers").group(1)
        _wait_for(lambda: len(_children(proc.pid)) == 3, what="two workers and the controllers")
        before = _children(proc.pid)

        trust = ssl.create_default_context(cafile=str(ca))

        def healthz() -> int:
            return httpx.get(f"{url}/healthz", verify=trust, timeout=30).status_code

        _wait_for(lambda: healthz() == 200, what="https answers")
        good = cert.read_bytes()
        cert.write_text("not a certificate\n")
        os.kill(proc.pid, signal.SIGHUP)
        refused = _printed(log, r"server: restart refused, the old workers go on: (.*)")
        assert "HETEROFLOW_TLS_CERT_FILE" in refused.group(1), refused.group(0)
        time.sleep(2)  # nothing was started: the same processes, still serving
        assert _children(proc.pid) == before
        assert healthz() == 200

        cert.write_bytes(good)
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(lambda: not _children(proc.pid) & before, 90, "the old generation gone")
        _wait_for(lambda: len(_children(proc.pid)) == 3, 60, "a whole new generation")
        _wait_for(lambda: healthz() == 200, what="the new generation answers")
    finally:
        _stop(proc)


@pytest.mark.feature("P4")
def test_the_restart_check_says_when_the_database_does_not_answer(pg_empty_url: str) -> None:
    assert database_problem(pg_empty_url) is None
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said = database_problem(f"postgresql://hf:s3cret-pw@127.0.0.1:{port}/hf", timeout_s=2)
    assert said is not None and said.startswith("the database does not answer: "), said
    assert "s3cret-pw" not in said
