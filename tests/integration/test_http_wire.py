"""The gateway's HTTP/1.1 client (``gateway.http_wire``) against real sockets on
127.0.0.1: framing (length, chunked, until close, no body), keep-alive pooling and when a
connection must not be pooled, the failure classes and whether each proves that nothing
was sent or that nothing was answered (what failover and resends rest on:
``gateway.retry``), the silence timeout, back-pressure, and a cancelled caller closing
the connection."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from heteroflow.gateway.wire import http_wire as wire

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _Server:
    """A raw TCP server: counts connections, notes the requests' heads, and sees EOFs."""

    def __init__(self, handler: Handler | None = None, *, keep_answering: bytes = b"") -> None:
        self.handler = handler or self._answer_each
        self.answer = keep_answering
        self.connections = 0
        self.heads: list[bytes] = []
        self.closed_by_client = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> _Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def _answer_each(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await self.read_request(r) is not None:
            w.write(self.answer)
            await w.drain()

    async def read_request(self, r: asyncio.StreamReader) -> bytes | None:
        """One request's head and body; None at the client's EOF."""
        try:
            head = await r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
            return None
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return await r.readexactly(length)


def _pool(
    *, connect_timeout_s: float = 2.0, read_timeout_s: float = 5.0, keepalive_s: float = 4.0
) -> wire.Pool:
    return wire.Pool(
        connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, keepalive_s=keepalive_s
    )


def _answer(body: bytes, *extra: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
        % (
            len(body),
            b"".join(extra),
            body,
        )
    )


async def test_a_keep_alive_connection_serves_request_after_request() -> None:
    srv = _Server(keep_answering=_answer(b'{"ok":true}'))
    async with srv:
        pool = _pool()
        for _ in range(3):
            resp = await pool.request(
                b"POST",
                srv.url + "/v1/chat/completions?x=1",
                b'{"a":1}',
                wire.header("X-Request-Id", "r1"),
            )
            assert resp.status == 200 and resp.content_type == "application/json"
            assert await resp.read() == b'{"ok":true}'
            resp.release()
        pool.close()
    assert srv.connections == 1
    head = srv.heads[0]
    assert head.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nContent-Length: 7\r\n" in head
    assert b"\r\nX-Request-Id: r1\r\n" in head


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            b"hello world",
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok"),
    ],
    ids=["chunked", "no-body", "informational-first"],
)
async def test_framed_answers_are_read_whole_and_the_connection_reused(
    answer: bytes, body: bytes
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await srv.read_request(r) is not None:
            w.write(answer)

    srv = _Server(handler)
    async with srv:
        pool = _pool()
        for _ in range(2):
            resp = await pool.request(b"GET", srv.url + "/v1/models")
            assert await resp.read() == body
            resp.release()
        pool.close()
    assert srv.connections == 1


async def test_a_body_that_ends_with_the_connection_is_complete_and_never_pooled() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        await w.drain()

    srv = _Server(handler)
    async with srv:
        pool = _pool()
        for _ in range(2):
            resp = await pool.request(b"GET", srv.url + "/x")
            assert await resp.read() == b"until the end"
            resp.release()
        pool.close()
    assert srv.connections == 2


async def test_connection_close_or_an_unread_answer_is_never_pooled() -> None:
    srv = _Server(keep_answering=_answer(b"x" * 10, b"Connection: close\r\n"))
    async with srv:
        pool = _pool()
        for _ in range(2):
            resp = await pool.request(b"GET", srv.url + "/x")
            assert await resp.read() == b"x" * 10
            resp.release()
        assert srv.connections == 2

    async def slow_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await srv.read_request(r) is not None:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            await asyncio.sleep(0.1)
            w.write(b"y" * 100_000)

    srv = _Server(slow_body)
    async with srv:
        for _ in range(2):
            resp = await pool.request(b"GET", srv.url + "/x")
            resp.release()  # before the body came: the connection is dropped
        assert srv.connections == 2
        resp = await pool.request(b"GET", srv.url + "/x", fresh=True)
        assert len(await resp.read()) == 100_000
        resp.release()  # a fresh (resend) connection is never pooled either
        resp = await pool.request(b"GET", srv.url + "/x")
        assert len(await resp.read()) == 100_000
        resp.release()
        pool.close()
        assert srv.connections == 4


async def test_a_refused_connection_proves_that_nothing_was_sent() -> None:
    srv = _Server()
    async with srv:
        url = srv.url
    with pytest.raises(wire.ConnectFailed) as err:
        await _pool().request(b"POST", url + "/v1/chat/completions", b"{}")
    assert err.value.nothing_sent and "refused" in err.value.reason.lower()


async def test_a_connect_timeout_proves_that_nothing_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()

    async def never(*_a: Any, **_k: Any) -> Any:
        await asyncio.sleep(30)

    monkeypatch.setattr(loop, "create_connection", never)
    with pytest.raises(wire.ConnectTimeout) as err:
        await _pool(connect_timeout_s=0.1).request(b"POST", "http://127.0.0.1:9/v1/x", b"{}")
    assert err.value.nothing_sent and isinstance(err.value, TimeoutError)


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a killed process's kernel may."""
    w.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )
    w.transport.abort()


@pytest.mark.parametrize("end", ["close", "reset"])
async def test_a_backend_that_reads_the_request_and_dies_provably_did_not_answer(
    end: str,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)  # read it, then die without a word
        if end == "reset":
            _reset(w)

    srv = _Server(handler)
    async with srv:
        with pytest.raises(wire.Disconnected) as err:
            await _pool().request(b"POST", srv.url + "/v1/chat/completions", b"{}")
    # It may have read the request (never proof that nothing was sent), but nothing of
    # an answer came back: gateway.retry may send it to another backend.
    assert not err.value.nothing_sent and err.value.unanswered and srv.heads


@pytest.mark.parametrize("end", ["close", "reset"])
@pytest.mark.parametrize(
    "said",
    [b"HTTP/1.1 2", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"id\""],
    ids=["status-line-begun", "body-begun"],
)
async def test_a_backend_that_dies_mid_answer_answered_in_part(end: str, said: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(said)
        await w.drain()
        await asyncio.sleep(0.1)  # the bytes reach the client before the end
        if end == "reset":
            _reset(w)

    srv = _Server(handler)
    async with srv:
        with pytest.raises(wire.Disconnected) as err:
            resp = await _pool().request(b"POST", srv.url + "/v1/chat/completions", b"{}")
            try:
                await resp.read()
            finally:
                resp.close()
    assert not err.value.nothing_sent and not err.value.unanswered


async def test_a_pooled_connection_the_backend_closed_is_not_used_again() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(_answer(b"{}"))  # promises keep-alive, then closes (cpp-httplib after SSE)
        await w.drain()

    srv = _Server(handler)
    async with srv:
        pool = _pool()
        for _ in range(3):
            resp = await pool.request(b"POST", srv.url + "/x", b"{}")
            assert await resp.read() == b"{}"
            resp.release()
            for _ in range(500):  # the close reaches us before the next request
                if all(c.lost for conns in pool._idle.values() for c in conns):
                    break
                await asyncio.sleep(0.01)
        pool.close()
    assert srv.connections == 3


async def test_a_pooled_connection_found_closing_at_the_write_is_unwritten() -> None:
    srv = _Server(keep_answering=_answer(b'{"ok":true}'))
    async with srv:
        pool = _pool()
        resp = await pool.request(b"POST", srv.url + "/x", b"{}")
        await resp.read()
        resp.release()
        (conn,) = pool._idle[("http", "127.0.0.1", int(srv.url.rsplit(":", 1)[1]))]
        pooled = pool._checkout(conn.origin, asyncio.get_running_loop().time())
        assert pooled is conn and conn.transport is not None
        conn.transport.close()  # as if the peer's FIN were seen between checkout and write
        with pytest.raises(wire.Unwritten) as err:
            conn.send(wire.Response(conn, pool, True), b"POST /x HTTP/1.1\r\n\r\n", b"", 5.0)
        assert err.value.nothing_sent
        pool.close()
    assert len(srv.heads) == 1  # the second request never left


_CHUNKS = 24


async def test_silence_times_out_but_a_slow_steady_stream_does_not() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        body = await srv.read_request(r)
        if body == b"silent":
            await asyncio.sleep(5)
            return
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n")
        # 1.2 s in all, never silent for the 0.6 s timeout (a busy box may stall the
        # loop half a second without failing it)
        for i in range(_CHUNKS):
            await asyncio.sleep(0.05)
            w.write(b"%x\r\ndata: %d\n\n\r\n" % (len(b"data: %d\n\n" % i), i))
            await w.drain()
        w.write(b"0\r\n\r\n")

    srv = _Server(handler)
    async with srv:
        pool = _pool(read_timeout_s=0.6)
        with pytest.raises(wire.ReadTimeout) as err:
            await pool.request(b"POST", srv.url + "/x", b"silent")
        assert not err.value.nothing_sent and isinstance(err.value, TimeoutError)
        assert not err.value.unanswered  # a silence is no proof: it may be generating
        resp = await pool.request(b"POST", srv.url + "/x", b"steady")
        got = b"".join([chunk async for chunk in resp.iter_any()])
        resp.release()
        assert got == b"".join(b"data: %d\n\n" % i for i in range(_CHUNKS))
        pool.close()


async def test_a_slow_reader_pauses_the_backend_and_loses_nothing() -> None:
    size = 4 * 1024 * 1024

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for i in range(64):
            w.write(bytes([i]) * (size // 64))
            await w.drain()

    srv = _Server(handler)
    async with srv:
        pool = _pool()
        resp = await pool.request(b"GET", srv.url + "/big")
        parts = []
        async for chunk in resp.iter_any():
            parts.append(chunk)
            await asyncio.sleep(0.01)  # a client slower than the backend
        resp.release()
        pool.close()
    data = b"".join(parts)
    # paused at 256 KiB buffered (plus at most one read): never the whole 4 MiB at once
    assert len(data) == size and max(map(len, parts)) <= 600_000
    assert data == b"".join(bytes([i]) * (size // 64) for i in range(64))


async def test_a_cancelled_caller_closes_the_connection() -> None:
    seen_eof = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        if await r.read(1) == b"":  # the engine sees its client leave
            seen_eof.set()

    srv = _Server(handler)
    async with srv:
        pool = _pool()
        task = asyncio.create_task(pool.request(b"POST", srv.url + "/x", b"{}"))
        while not srv.heads:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(seen_eof.wait(), 2)


async def test_idle_connections_close_after_the_keep_alive_time() -> None:
    seen_eof = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(_answer(b"{}"))
        await w.drain()
        if await srv.read_request(r) is None:
            seen_eof.set()

    srv = _Server(handler)
    async with srv:
        pool = _pool(keepalive_s=0.2)
        resp = await pool.request(b"GET", srv.url + "/x")
        await resp.read()
        resp.release()
        await asyncio.wait_for(seen_eof.wait(), 2)  # closed by us, not by the backend
        assert not pool._idle
        pool.close()


async def test_garbage_is_a_bad_answer_and_headers_cannot_be_forged() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"SPDY/9 banana\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    srv = _Server(handler)
    async with srv:
        with pytest.raises(wire.BadAnswer) as err:
            await _pool().request(b"GET", srv.url + "/x")
    assert not err.value.nothing_sent
    for name, value in (("X-Id", "a\r\nX-Evil: 1"), ("X-Id", "a\nb"), ("X:Id", "a")):
        with pytest.raises(ValueError):
            wire.header(name, value)
    assert wire.header("Authorization", "Bearer k") == b"Authorization: Bearer k\r\n"
    with pytest.raises(ValueError):
        await _pool().request(b"GET", "ftp://127.0.0.1/x")
