"""The node's door to an engine (C14) on real sockets: what passes, what it answers
itself, and that a refused request never reaches the engine."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from heteroflow.agent.engine_door import Door, EngineDoors
from heteroflow.agent.runtime.protocol import PortInUse
from heteroflow.core.engine_access import ENGINE_ADDRESS, bearer_matches, door_admits
from tests.conftest import free_port

KEY = "hfe-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Engine(ThreadingHTTPServer):
    """A stand-in engine on the private loopback that records every request it reads."""

    def __init__(self, port: int) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        super().__init__((ENGINE_ADDRESS, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Engine

    def _answer(self) -> None:
        body = b""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while (size := int(self.rfile.readline().strip(), 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        elif length := int(self.headers.get("content-length") or 0):
            body = self.rfile.read(length)
        self.server.seen.append((self.command, self.path, body))
        out = b"engine:" + self.path.encode() + b":" + body
        self.send_response(200)
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def door() -> Iterator[tuple[str, Engine, EngineDoors]]:
    port = free_port()
    engine = Engine(port)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    doors = EngineDoors()
    doors.open("t1", Door("127.0.0.1", port, KEY))
    try:
        yield f"http://127.0.0.1:{port}", engine, doors
    finally:
        doors.shutdown()
        engine.shutdown()
        engine.server_close()


@pytest.mark.feature("C14")
def test_only_requests_with_the_key_to_admitted_routes_reach_the_engine(
    door: tuple[str, Engine, EngineDoors],
) -> None:
    url, engine, _ = door
    assert httpx.post(url + "/v1/chat/completions", content=b"{}").status_code == 401
    assert httpx.post(url + "/sleep?level=2", headers=AUTH).status_code == 404
    r = httpx.get(url + "/collective_rpc", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert engine.seen == []  # nothing refused got through
    r = httpx.post(url + "/v1/chat/completions?x=1", headers=AUTH, content=b'{"a": 1}')
    assert r.status_code == 200 and r.content == b'engine:/v1/chat/completions?x=1:{"a": 1}'
    assert engine.seen == [("POST", "/v1/chat/completions?x=1", b'{"a": 1}')]


def test_a_chunked_body_and_requests_kept_alive_are_each_checked(
    door: tuple[str, Engine, EngineDoors],
) -> None:
    url, engine, _ = door
    with httpx.Client(headers=AUTH) as client:
        parts = iter([b"one ", b"two ", b"three"])
        r = client.post(url + "/v1/completions", content=parts)  # chunked
        assert r.content == b"engine:/v1/completions:one two three"
        assert client.get(url + "/health").content == b"engine:/health:"
        assert client.get(url + "/slots").status_code == 404  # same connection: checked too
    assert [path for _, path, _ in engine.seen] == ["/v1/completions", "/health"]


def test_a_refused_request_behind_an_admitted_one_never_reaches_the_engine(
    door: tuple[str, Engine, EngineDoors],
) -> None:
    url, engine, _ = door
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        auth = f"Authorization: Bearer {KEY}\r\n"
        s.sendall(
            f"GET /health HTTP/1.1\r\nHost: x\r\n{auth}\r\n"
            f"POST /sleep HTTP/1.1\r\nHost: x\r\n{auth}content-length: 0\r\n\r\n".encode()
        )
        s.settimeout(5)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert b" 404 " in data
    assert [path for _, path, _ in engine.seen] in ([], ["/health"])


def test_closing_a_door_ends_its_connections_and_frees_its_port(
    door: tuple[str, Engine, EngineDoors],
) -> None:
    url, _, doors = door
    with httpx.Client(headers=AUTH) as client:
        assert client.get(url + "/health").status_code == 200
        doors.close("t1")
        with pytest.raises(httpx.TransportError):
            client.get(url + "/health")
    port = int(url.rsplit(":", 1)[1])
    doors.open("t2", Door("127.0.0.1", port, "hfe-other"))  # the port handed on
    assert httpx.get(url + "/health", headers=AUTH).status_code == 401  # the old key
    assert httpx.get(url + "/health", headers={"Authorization": "Bearer hfe-other"}).is_success


def test_a_taken_port_is_port_in_use_and_keep_retries_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        doors = EngineDoors()
        try:
            with pytest.raises(PortInUse) as exc:
                doors.open("t", Door("127.0.0.1", port, KEY))
            assert exc.value.ports == (port,)
            doors.keep({"t": Door("127.0.0.1", port, KEY)})  # logged, not raised
            assert doors.doors() == {}
        finally:
            doors.shutdown()


def test_an_engine_that_is_not_there_is_a_502() -> None:
    doors = EngineDoors()
    port = free_port()
    doors.open("t", Door("127.0.0.1", port, KEY))
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", headers=AUTH)
        assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"
    finally:
        doors.shutdown()


@pytest.mark.parametrize(("path", "admitted"), [
    ("/v1/chat/completions", True), ("/v1/models?x=1", True), ("/health", True),
    ("/metrics", True), ("/v1/embeddings", True),
    ("/sleep", False), ("/wake_up", False), ("/is_sleeping", False),
    ("/collective_rpc", False), ("/reset_prefix_cache", False), ("/slots", False),
    ("/props", False), ("/tokenize", False), ("/v1/load_lora_adapter", False),
    ("/v1/unload_lora_adapter", False), ("/v1/../sleep", False), ("/v1/%2e%2e/sleep", False),
    ("//sleep", False), ("/v1//x", False), ("v1/models", False), ("*", False),
    ("http://x/v1/models", False), ("/v1", False), ("/healthz", False),
])
def test_the_routes_a_door_admits(path: str, admitted: bool) -> None:
    assert door_admits(path) is admitted


@pytest.mark.parametrize(("header", "ok"), [
    (f"Bearer {KEY}".encode(), True), (f"bearer {KEY}".encode(), True),
    (KEY.encode(), False), (b"Bearer ", False), (b"Bearer hfe-test-keyX", False),
    (f"Basic {KEY}".encode(), False), (None, False),
])
def test_the_key_is_a_bearer_token(header: bytes | None, ok: bool) -> None:
    assert bearer_matches(header, KEY) is ok
    assert not bearer_matches(header, "")  # no key: nothing matches
