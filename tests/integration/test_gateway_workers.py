"""``heteroflow gateway --routes FILE --workers 2`` as real processes (issue 31, P4): both
workers answer on one port, they balance least_connections like one gateway (one
in-flight table), a killed worker is replaced, SIGHUP restarts the workers without a
failed request, SIGTERM lets an in-flight stream finish, and a key's limit stays exact
across the workers (Redis). Without Redis, ``--workers 2`` is refused in one line.

Generous timeouts and no timing asserts: the machine may be a loaded 2-core box.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.schemas.routing import hash_key
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from heteroflow.testing.up_stack import listening_url, steady_load

from .conftest import REDIS_URL

KEY = "sk-workers-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
WORKER = "x-heteroflow-worker"
BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout:g} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[tuple[FakeOpenAIBackend, str]]]:
    thread = UvicornThread()
    made = []
    for name in ("a", "b"):
        fake = FakeOpenAIBackend(["engine-s"], name=name)
        made.append((fake, f"http://127.0.0.1:{thread.serve(fake)}/v1"))
    try:
        yield made
    finally:
        thread.stop()


class Workers:
    """The parent process of ``heteroflow gateway --workers 2`` and its URL."""

    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url

    def children(self) -> set[int]:
        pid = self.proc.pid
        try:
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return set()
        return {int(p) for p in text.split()}

    def post(self, body: dict[str, Any], **kw: Any) -> httpx.Response:
        # a new connection per call: the kernel hands it to whichever worker accepts
        return httpx.post(
            f"{self.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30, **kw
        )


def _start(routes: dict[str, Any], tmp: Path, env: dict[str, str]) -> Workers:
    path = tmp / "routes.json"
    path.write_text(json.dumps(routes))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "heteroflow.cli",
            "gateway",
            "--port",
            "0",
            "--routes",
            str(path),
            "--workers",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert proc.stdout is not None
    return Workers(proc, listening_url(proc.stdout, "the gateway", 60))


@pytest.fixture
def start(tmp_path: Path, prefix: str) -> Iterator[Callable[[dict[str, Any]], Workers]]:
    made: list[Workers] = []

    def make(routes: dict[str, Any]) -> Workers:
        env = {"HETEROFLOW_REDIS_URL": REDIS_URL, "HETEROFLOW_REDIS_KEY_PREFIX": prefix}
        made.append(_start(routes, tmp_path, env))
        return made[-1]

    yield make
    for w in made:
        children = w.children()
        if w.proc.poll() is None:
            w.proc.terminate()  # a graceful stop: the parent removes its metrics folder
            try:
                w.proc.wait(30)
            except subprocess.TimeoutExpired:
                w.proc.kill()  # its workers get SIGTERM from the kernel (PR_SET_PDEATHSIG)
                w.proc.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _routes(*urls: str, **limits: Any) -> dict[str, Any]:
    return {
        "models": {"chat": {"algorithm": "least_connections", "backends": list(urls)}},
        "keys": {"w-1": {"sha256": hash_key(KEY), "tenant": "w", **limits}},
    }


def _both_workers(gw: Workers) -> tuple[set[str], int]:
    """Concurrent requests on new connections until two workers have answered; the
    workers seen and the requests sent."""
    seen: set[str] = set()
    sent = 0
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(8) as pool:
        while len(seen) < 2 and time.monotonic() < deadline:
            answers = list(pool.map(lambda _: gw.post({**BODY, "fake_delay_ms": 20}), range(32)))
            assert {r.status_code for r in answers} == {200}
            seen |= {r.headers[WORKER] for r in answers}
            sent += len(answers)
    return seen, sent


class Stream(threading.Thread):
    """One streamed request on a connection of its own, read to the end."""

    def __init__(self, gw: Workers, client: httpx.Client, ms: int) -> None:
        super().__init__(daemon=True)
        self.gw, self.client, self.ms = gw, client, ms
        self.text = ""
        self.status = 0

    def run(self) -> None:
        body = {**BODY, "stream": True, "fake_chunks": 3, "fake_delay_ms": self.ms}
        with self.client.stream(
            "POST", f"{self.gw.url}/v1/chat/completions", json=body, headers=AUTH
        ) as r:
            self.status = r.status_code
            self.text = r.read().decode()


def _clients_by_worker(gw: Workers) -> dict[str, list[httpx.Client]]:
    """Keep-alive clients, each on one connection, grouped by the worker that holds it."""
    by: dict[str, list[httpx.Client]] = {}
    deadline = time.monotonic() + 60
    while min((len(v) for v in by.values()), default=0) < 3 or len(by) < 2:
        assert time.monotonic() < deadline, f"connections did not reach both workers: {by}"
        clients = [
            httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1)) for _ in range(8)
        ]

        def probe(c: httpx.Client) -> str:
            body = {**BODY, "fake_delay_ms": 20}
            r = c.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH)
            return r.headers[WORKER]

        with ThreadPoolExecutor(8) as pool:
            for c, pid in zip(clients, pool.map(probe, clients), strict=True):
                by.setdefault(pid, []).append(c)
    return by


@pytest.mark.feature("P4")
def test_two_workers_share_the_port_balance_as_one_restart_and_drain(
    start: Callable[[dict[str, Any]], Workers],
    engines: list[tuple[FakeOpenAIBackend, str]],
) -> None:
    (fa, ua), (fb, ub) = engines
    gw = start(_routes(ua, ub))
    _wait_for(lambda: len(gw.children()) == 2, what="two workers")
    pids = gw.children()
    # both workers answer, each saying who it is; /metrics (from either) counts them all
    seen, sent = _both_workers(gw)
    assert seen == {str(p) for p in pids}
    series = (
        'heteroflow_gateway_requests_total{path="/v1/chat/completions",model="chat",status="200"}'
    )

    def counted() -> int:
        text = httpx.get(f"{gw.url}/metrics", timeout=30).text
        line = next((x for x in text.splitlines() if x.startswith(series)), f"{series} 0")
        return int(line.rsplit(" ", 1)[1])

    _wait_for(lambda: counted() == sent, what=f"/metrics counting {sent} requests")

    # least_connections over one shared table: requests that reach the two workers in
    # turn split 3/3 over the two backends (each worker on its own would send its 1st
    # and 3rd to backend a, its 2nd to b: 4/2)
    by = _clients_by_worker(gw)
    one, two = (by[p] for p in list(by)[:2])
    streams: list[Stream] = []
    try:
        for i in range(6):
            s = Stream(gw, (one if i % 2 == 0 else two)[i // 2], 4000)
            s.start()
            streams.append(s)

            def arrived(n: int = i + 1) -> bool:
                return fa.in_flight + fb.in_flight == n

            _wait_for(arrived, what="stream arrived")
        assert (fa.in_flight, fb.in_flight) == (3, 3)
    finally:
        for s in streams:
            s.join(60)
        for c in [*one, *two]:
            c.close()
    assert all(s.status == 200 and s.text.endswith("data: [DONE]\n\n") for s in streams)

    # a killed worker is replaced, into the same port
    victim = sorted(pids)[0]
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: len(gw.children()) == 2 and victim not in gw.children(), what="restart")
    assert gw.post(BODY).status_code == 200

    # SIGHUP: new workers, then the old ones stop; no request fails meanwhile
    before = gw.children()
    with steady_load(lambda: gw.post({**BODY, "fake_delay_ms": 20}).status_code, 4) as statuses:
        _wait_for(lambda: len(statuses) > 10, what="load running")
        gw.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: len(gw.children() & before) == 0, what="old workers gone")
        _wait_for(lambda: len(gw.children()) == 2, what="two new workers")
        n = len(statuses)
        _wait_for(lambda: len(statuses) > n + 10, what="load after the restart")
    assert statuses and set(statuses) == {200}

    # SIGTERM: a stream in flight finishes, then every process exits 0
    # the load's last requests end first (zeroing the counts instead raced them: one
    # that ended after the zeroing made the sum -1, and the stream's never read 1)
    _wait_for(lambda: fa.in_flight + fb.in_flight == 0, what="the load's requests to end")
    stream = Stream(gw, httpx.Client(timeout=60), 1500)
    stream.start()
    _wait_for(lambda: fa.in_flight + fb.in_flight == 1, what="stream in flight")
    children = gw.children()
    gw.proc.send_signal(signal.SIGTERM)
    stream.join(60)
    assert stream.status == 200 and stream.text.endswith("data: [DONE]\n\n")
    assert gw.proc.wait(60) == 0
    assert not any(Path(f"/proc/{p}").exists() for p in children)


@pytest.mark.feature("M8")
@pytest.mark.feature("P4")
def test_a_key_limit_is_exact_across_two_workers(
    start: Callable[[dict[str, Any]], Workers],
    engines: list[tuple[FakeOpenAIBackend, str]],
) -> None:
    """The multi-gateway limit test (test_gateway_limits_redis), against workers: 60
    requests, an RPM of 30; the real clock refills one every 2 s while they run."""
    (fa, ua), _ = engines
    gw = start(_routes(ua, rpm_limit=30))
    before = len(fa.received)
    began = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: gw.post(BODY), range(60)))
    elapsed = time.monotonic() - began
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 429}
    assert len({r.headers[WORKER] for r in answers}) == 2  # both workers took requests
    ok = statuses.count(200)
    assert 30 <= ok <= 30 + int(elapsed / 2) + 1
    assert len(fa.received) - before == ok  # a refused request never reached the engine


def test_two_workers_without_redis_are_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    path.write_text(json.dumps(_routes("http://127.0.0.1:9/v1")))
    env = {k: v for k, v in os.environ.items() if k != "HETEROFLOW_REDIS_URL"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "heteroflow.cli",
            "gateway",
            "--port",
            "0",
            "--routes",
            str(path),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "HETEROFLOW_REDIS_URL" in lines[0] and "--workers 1" in lines[0]
