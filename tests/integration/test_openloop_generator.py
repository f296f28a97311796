"""The open-loop load generator (``bench/openloop``, issue 31 item 2), against a tiny HTTP
server in this process.

The server is one thread with one selector: when it stalls, every connection waits, as a
proxy's event loop does. At a fixed rate the generator must charge the stall to every
request scheduled during it (latency from the intended send time: coordinated omission
corrected), where a closed loop shows one slow request; keep the rate it was asked for;
read chunked streams to their end; and count a connection the server closes mid-request
as an error.

Bounds are generous (the machine may be a loaded 2-core box): only behaviour that a
generator measuring from the actual send, or losing requests, would fail.
"""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 0.3


@dataclass
class Mode:
    stall_at: int = 0  # stall STALL_S once, before answering this request (1-based); 0: never
    close_every: int = 0  # close the connection instead of answering every Nth request
    chunked: bool = False  # answer as an SSE-like chunked stream ending with [DONE]


class TinyServer:
    """HTTP/1.1 keep-alive on one thread; each response leaves in one send."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.served = 0
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.listener.setblocking(False)
        self.port = int(self.listener.getsockname()[1])
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.bufs: dict[socket.socket, bytes] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _answer(self) -> bytes:
        if not self.mode.chunked:
            body = b'{"choices": [{"message": {"content": "hi"}}]}'
            return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        out += b"Transfer-Encoding: chunked\r\n\r\n"
        events = [b'data: {"n": %d}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]
        for ev in events:
            out += b"%x\r\n%s\r\n" % (len(ev), ev)
        return out + b"0\r\n\r\n"

    def _request(self, conn: socket.socket) -> None:
        buf = self.bufs[conn]
        while b"\r\n\r\n" in buf:
            head, rest = buf.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                break
            buf = rest[length:]
            self.served += 1
            if self.mode.stall_at and self.served == self.mode.stall_at:
                time.sleep(STALL_S)  # the whole server stalls, as a blocked event loop does
            if self.mode.close_every and self.served % self.mode.close_every == 0:
                self._drop(conn)
                return
            conn.sendall(self._answer())
        self.bufs[conn] = buf

    def _drop(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.bufs.pop(conn, None)
        conn.close()

    def _run(self) -> None:
        while not self.stopping:
            for key, _ in self.sel.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    with_conn, _ = self.listener.accept()
                    with_conn.setblocking(True)  # responses are small: one blocking send
                    with_conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.sel.register(with_conn, selectors.EVENT_READ)
                    self.bufs[with_conn] = b""
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock)
                    continue
                self.bufs[sock] += data
                try:
                    self._request(sock)
                except OSError:
                    if sock in self.bufs:
                        self._drop(sock)

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)
        for conn in list(self.bufs):
            self._drop(conn)
        self.listener.close()


@pytest.fixture(scope="module")
def generator() -> Path:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/openloop/build.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return Path(out.stdout.strip())


@pytest.fixture
def body(tmp_path: Path) -> Path:
    path = tmp_path / "body.json"
    path.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    return path


def serve(mode: Mode) -> Iterator[TinyServer]:
    server = TinyServer(mode)
    try:
        yield server
    finally:
        server.stop()


def run(
    binary: Path, port: int, body: Path, *args: str, samples: Path | None = None
) -> dict[str, Any]:
    argv = [str(binary), "--url", f"http://127.0.0.1:{port}/v1/chat/completions"]
    argv += ["--body", str(body), "--header", "Authorization: Bearer sk-test", *args]
    if samples is not None:
        argv += ["--samples", str(samples)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def latencies(samples: Path) -> list[float]:
    """Latency (ms) of each ok request, from the --samples file."""
    rows = [line.split() for line in samples.read_text().splitlines()]
    return [float(r[1]) for r in rows if r[5] == "1"]


def test_a_stall_is_charged_to_every_request_scheduled_during_it(
    generator: Path, body: Path, tmp_path: Path
) -> None:
    # 200 req/s for 2 s: ~60 requests fall inside the 300 ms stall (request 100, at ~0.5 s)
    for server in serve(Mode(stall_at=100)):
        res = run(
            generator, server.port, body, "--rate", "200", "--connections", "8",
            "--duration", "2", "--expect", '"choices"', samples=tmp_path / "open.txt",
        )  # fmt: skip
    assert res["mode"] == "open" and res["errors"] == 0, res
    assert res["scheduled"] == 400 and res["ok"] == 400, res
    slow = [ms for ms in latencies(tmp_path / "open.txt") if ms >= 100]
    # requests scheduled in the stall's first ~200 ms waited >= 100 ms each: ~40 of them
    # (a generator timing from its actual send would show at most 8: one per connection)
    assert len(slow) >= 20, sorted(slow)
    assert res["lat_ms"]["max"] >= 250, res["lat_ms"]
    assert res["lat_ms"]["p99"] >= 150, res["lat_ms"]
    # the asked-for rate held (the schedule does not slip behind a stall)
    assert 150 <= res["rps"] <= 210, res
    assert res["queued_max"] >= 1, res  # 8 connections were all waiting on the stall

    # the same stall under a closed loop of one connection: one slow request
    for server in serve(Mode(stall_at=100)):
        closed = run(
            generator, server.port, body, "--connections", "1", "--duration", "1.5",
            "--expect", '"choices"', samples=tmp_path / "closed.txt",
        )  # fmt: skip
    assert closed["mode"] == "closed" and closed["errors"] == 0, closed
    assert closed["ok"] >= 100, closed
    # the stall is charged once (a busy machine may add a slow request or two of its own,
    # never the tens the open loop counted)
    closed_slow = [ms for ms in latencies(tmp_path / "closed.txt") if ms >= 100]
    assert 1 <= len(closed_slow) <= 3 and len(closed_slow) * 5 <= len(slow), closed_slow


def test_streams_are_read_to_the_end_at_the_asked_rate(generator: Path, body: Path) -> None:
    # 120 req/s: a third of what the test server streams on a busy core (at 300 the
    # suite's other worker and a benchmark beside it held the server to 157)
    for server in serve(Mode(chunked=True)):
        res = run(
            generator, server.port, body, "--rate", "120", "--connections", "4",
            "--duration", "1.5", "--expect", "[DONE]",
        )  # fmt: skip
    assert res["errors"] == 0 and res["ok"] == 180, res
    assert 96 <= res["rps"] <= 125, res
    assert res["lat_ms"]["p50"] < 100, res["lat_ms"]  # no stall here: no spurious waits
    # a body without the expected end is an error, not a success
    for server in serve(Mode(chunked=True)):
        missing = run(
            generator, server.port, body, "--rate", "100", "--connections", "2",
            "--duration", "0.5", "--expect", "[NOT THERE]",
        )  # fmt: skip
    assert missing["ok"] == 0 and missing["errors_by"]["body"] == 50, missing


def test_a_connection_closed_mid_request_is_an_error_and_the_run_goes_on(
    generator: Path, body: Path
) -> None:
    for server in serve(Mode(close_every=10)):
        res = run(
            generator, server.port, body, "--rate", "200", "--connections", "4",
            "--duration", "1", "--expect", '"choices"',
        )  # fmt: skip
    # every 10th request is dropped by the server: ~20 closed, the other ~180 answered
    assert res["errors_by"]["closed"] >= 15, res
    assert res["errors"] == res["errors_by"]["closed"] + res["errors_by"]["connect"], res
    assert res["ok"] >= 150 and res["ok"] + res["errors_by"]["closed"] == 200, res


def test_nobody_listening_is_an_error_not_a_silent_zero(generator: Path, body: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])  # bound, not listening: connections are refused
        res = run(generator, port, body, "--rate", "50", "--connections", "2", "--duration",
                  "0.4", "--timeout", "0.5")  # fmt: skip
    assert res["ok"] == 0 and res["errors_by"]["timeout"] == 20, res
    assert res["errors_by"]["connect"] >= 1, res
