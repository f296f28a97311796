"""The node's doors to its engines (FEATURES C14): the only way in from the network.

An engine listens on the node's private loopback address (``ENGINE_ADDRESS``); its
door listens on the task's booked port at the node's address — what the gateways call
— and relays a request only when it carries the engine's key and asks for a route the
door admits (``core.engine_access.door_admits``: the OpenAI surface, health, metrics).
Anything else is answered by the door itself: 401 without the key, 404 for a route only
the platform may call (``/sleep``, ``/collective_rpc``, LoRA loading, ``/slots``...);
400 for what is not HTTP/1.x. The agent reaches those routes over the loopback.

Requests are parsed (httptools' llhttp) and written on to the engine head by head and
body by body, so no byte of a refused request reaches it and two requests on one
connection are each checked; answers are relayed as they come, byte for byte. One
connection to the engine per client connection; reading pauses on either side while
the other side's buffer is full. All doors of a node share one event loop in a thread
of their own, so the agent's own work (heartbeats, probes) never delays a request.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

from heteroflow.agent.runtime.protocol import PortInUse
from heteroflow.core.engine_access import ENGINE_ADDRESS, bearer_matches, door_admits, door_port
from heteroflow.core.ports import ports_from_dicts
from heteroflow.schemas.nodes import TaskAssignment

log = logging.getLogger(__name__)

__all__ = ["Door", "DoorKeeper", "EngineDoors"]

_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Door:
    """One engine's door: listen on ``host:port``, relay to ``engine_host:port``."""

    host: str
    port: int
    key: str = field(repr=False)
    engine_host: str = ENGINE_ADDRESS


def _answer(status: int, reason: str, message: str, kind: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "code": None}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


NO_KEY = _answer(
    401, "Unauthorized",
    "this engine answers only the platform: call it through a HeteroFlow gateway",
    "authentication_error",
)
NOT_HERE = _answer(
    404, "Not Found", "this route of the engine is not reachable from the network",
    "not_found_error",
)
BAD_REQUEST = _answer(400, "Bad Request", "not an HTTP/1.x request", "invalid_request_error")
NO_ENGINE = _answer(
    502, "Bad Gateway", "the engine behind this door is not answering", "api_error"
)


class _Engine(asyncio.Protocol):
    """The door's connection to the engine: answers go back to the client as they come."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.client.send(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.engine_gone()

    def pause_writing(self) -> None:
        self.client.pause_reading()

    def resume_writing(self) -> None:
        self.client.resume_reading()


class _Client(asyncio.Protocol):
    """One connection from the network: each request's head checked before it goes on."""

    def __init__(self, door: Door, open_conns: set[_Client]) -> None:
        self.door = door
        self.open_conns = open_conns  # the door's: closed with it
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.engine: _Engine | None = None
        self.pending: list[bytes] | None = []  # written once the engine connection is up
        self.out: list[bytes] = []  # what this read lets through: one write per read
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunked = False
        self.done = False  # answered by the door, or gone: nothing more is relayed

    # -- the client side ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport
        self.open_conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(BAD_REQUEST)  # no protocol switch through the door
        except httptools.HttpParserError:
            self.refuse(BAD_REQUEST)
        if self.out and not self.done:
            self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = True
        self.open_conns.discard(self)
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.close()

    def pause_writing(self) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.resume_reading()

    # -- httptools callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url, self.headers, self.chunked = b"", [], False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.done:
            return
        auth = None
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"authorization":
                auth = value
            elif lower == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
        if not bearer_matches(auth, self.door.key):
            self.refuse(NO_KEY)
            return
        if not door_admits(self.url.decode("latin-1")):
            self.refuse(NOT_HERE)
            return
        version = self.parser.get_http_version()
        lines = [self.parser.get_method(), b" ", self.url, b" HTTP/", version.encode(), b"\r\n"]
        for name, value in self.headers:
            lines += [name, b": ", value, b"\r\n"]
        lines.append(b"\r\n")
        self.forward(b"".join(lines))

    def on_body(self, body: bytes) -> None:
        if self.done:
            return
        if self.chunked:
            self.forward(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            self.forward(body)

    def on_message_complete(self) -> None:
        if self.chunked and not self.done:
            self.forward(b"0\r\n\r\n")

    # -- the engine side -----------------------------------------------------------
    def forward(self, data: bytes) -> None:
        self.out.append(data)

    def _flush(self) -> None:
        data, self.out = b"".join(self.out), []
        if self.pending is None:
            assert self.engine is not None and self.engine.transport is not None
            self.engine.transport.write(data)
            return
        self.pending.append(data)
        if self.engine is None:
            self.engine = _Engine(self)
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.engine is not None
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            await loop.create_connection(lambda: engine, self.door.engine_host, self.door.port)
        except OSError:
            self.engine = None
            self.refuse(NO_ENGINE)
            return
        assert engine.transport is not None
        if self.done:
            engine.transport.close()
            return
        engine.transport.writelines(self.pending or [])
        self.pending = None

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def engine_gone(self) -> None:
        if self.transport is not None:
            self.transport.close()  # after what is buffered for the client

    def pause_reading(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def refuse(self, answer: bytes) -> None:
        """The door answers and closes: nothing more of this connection is relayed."""
        self.done = True
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.close()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()


class EngineDoors:
    """The doors of one node, each keyed by its task, on one loop in a thread of its own.

    ``open``/``close``/``keep`` are called from the agent's threads and wait for the
    door's loop; ``open`` raises ``PortInUse`` when the port is taken at the address.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # task id -> its door, listener and open client connections
        self._servers: dict[str, tuple[Door, asyncio.AbstractServer, set[_Client]]] = {}
        self._lock = threading.Lock()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="engine-doors",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._running_loop()).result(
            _CALL_TIMEOUT_S
        )

    def doors(self) -> dict[str, Door]:
        return {task_id: held[0] for task_id, held in self._servers.items()}

    def open(self, task_id: str, door: Door) -> None:
        """Open (or keep) ``task_id``'s door; a different door of the task is replaced."""
        self._call(self._open(task_id, door))

    def close(self, task_id: str) -> None:
        if task_id in self._servers:
            self._call(self._close(task_id))

    def keep(self, wanted: Mapping[str, Door]) -> None:
        """Exactly ``wanted`` open: the others closed, the missing opened (a port taken
        is logged and tried again at the next call)."""
        for task_id in [t for t in self._servers if t not in wanted]:
            self.close(task_id)
        for task_id, door in wanted.items():
            try:
                self.open(task_id, door)
            except PortInUse as exc:
                log.warning("door of task %s not open: %s", task_id, exc)

    def shutdown(self) -> None:
        if self._loop is None:
            return
        for task_id in list(self._servers):
            self.close(task_id)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop.close()
        self._loop = self._thread = None

    async def _open(self, task_id: str, door: Door) -> None:
        held = self._servers.get(task_id)
        if held is not None:
            if held[0] == door:
                return
            await self._close(task_id)
        for other, (d, *_) in list(self._servers.items()):
            if (d.host, d.port) == (door.host, door.port):  # a port handed on to a new task
                await self._close(other)
        loop = asyncio.get_running_loop()
        conns: set[_Client] = set()
        try:
            server = await loop.create_server(
                lambda: _Client(door, conns), door.host, door.port, reuse_address=True
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"host port {door.port} is already in use", (door.port,)) from exc
            raise
        self._servers[task_id] = (door, server, conns)
        log.info("door of task %s open on %s:%d", task_id, door.host, door.port)

    async def _close(self, task_id: str) -> None:
        held = self._servers.pop(task_id, None)
        if held is not None:
            held[1].close()
            for conn in list(held[2]):  # a connection must not outlive its door's task
                if conn.transport is not None:
                    conn.transport.abort()  # its connection_lost closes the engine side
            log.info("door of task %s closed", task_id)


def _door_port(t: TaskAssignment) -> int | None:
    ports = ports_from_dicts(t.ports)
    # G1: only rank 0 of a gang serves the API; the rank comes with every assignment (a
    # heartbeat's too), so a headless stage never opens a door
    return door_port(t.task_type, t.parallelism, ports[0].host_port if ports else 0, t.rank)


class DoorKeeper:
    """The launchers' doors (C14): which port of a task stands behind one, where the
    agent reaches the engine, and the node's ``EngineDoors``."""

    def __init__(self, address: str, engine_address: str = ENGINE_ADDRESS) -> None:
        self.address = address
        self.engine_address = engine_address
        self.doors = EngineDoors()

    def door_for(self, t: TaskAssignment) -> Door | None:
        port = _door_port(t)
        if port is None:
            return None
        return Door(self.address, port, t.engine_key, self.engine_address)

    def probe_host_for(self, t: TaskAssignment, port: int) -> str:
        return self.engine_address if port == _door_port(t) else self.address

    def open_for(self, t: TaskAssignment) -> None:
        """The task's door open before its engine starts (PortInUse when taken)."""
        door = self.door_for(t)
        if door is not None:
            self.doors.open(t.id, door)

    def keep_doors(self, tasks: list[TaskAssignment]) -> None:
        wanted = {t.id: d for t in tasks if (d := self.door_for(t)) is not None}
        self.doors.keep(wanted)

    def close_doors(self) -> None:
        self.doors.shutdown()
