"""A minimal pipelined Redis (RESP2) connection for the gateway's hot path.

Why not ``redis.asyncio``: measured here, one EVALSHA through redis-py costs ~80-140 us
of gateway CPU (command packing, a connection pool, per-line parsing, a ``wait_for`` per
read) against a gateway budget of 0.30 ms per request; this connection costs ~10-25 us.
It does only what the limit store needs: one TCP (or TLS) connection per event loop,
commands written as they come (coalesced into one write per loop turn) and replies
matched first-in first-out, ``EVALSHA`` with a ``SCRIPT LOAD`` on ``NOSCRIPT``, and
``AUTH`` / ``SELECT`` from the URL. Timeouts are the connection's: a call not answered
within ``reply_timeout_s`` fails with ``TimeoutError`` together with every call behind it
and the connection is dropped, so a slow Redis never leaves replies mismatched, and the
next call reconnects. One timer per connection, armed at the oldest call's deadline and
moved on when it fires, instead of an ``asyncio.timeout`` per call (a ``Timeout``, a
timer handle in the loop's heap and its cancellation: a third of an admission's CPU).
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import unquote, urlsplit

Reply = Any  # bytes | int | None | list[Reply] | ReplyError


class ReplyError(Exception):
    """An error reply from Redis (``-ERR ...``)."""


class _Incomplete:
    pass


_INCOMPLETE = _Incomplete()


def encode(args: Sequence[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def parse(buf: bytearray, pos: int) -> tuple[Reply, int] | _Incomplete:
    """One reply starting at ``pos``: (value, next position), or incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _INCOMPLETE
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    if kind == 0x24:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, end + 2
        if len(buf) < end + 4 + n:
            return _INCOMPLETE
        return bytes(buf[end + 2 : end + 2 + n]), end + 4 + n
    if kind == 0x3A:  # : integer
        return int(line), end + 2
    if kind == 0x2B:  # + simple string
        return line, end + 2
    if kind == 0x2D:  # - error
        return ReplyError(line.decode("utf-8", "replace")), end + 2
    if kind == 0x2A:  # * array
        n = int(line)
        if n < 0:
            return None, end + 2
        items: list[Reply] = []
        p = end + 2
        for _ in range(n):
            r = parse(buf, p)
            if isinstance(r, _Incomplete):
                return r
            items.append(r[0])
            p = r[1]
        return items, p
    raise ValueError(f"unexpected RESP reply type {chr(kind)!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, reply_timeout_s: float) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiters: deque[asyncio.Future[Reply]] = deque()
        self.deadlines: deque[float] = deque()  # loop time by which each waiter's reply is due
        self.buf = bytearray()
        self.lost: BaseException | None = None
        self._out: list[bytes] = []
        self._timeout_s = reply_timeout_s
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport

    def send(self, cmd: bytes, fut: asyncio.Future[Reply]) -> None:
        loop = self._loop
        deadline = loop.time() + self._timeout_s
        self.waiters.append(fut)
        self.deadlines.append(deadline)
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)
        if not self._out:
            loop.call_soon(self._flush)
        self._out.append(cmd)

    def _expire(self) -> None:
        """The oldest call's deadline came: wait on for it if it was answered meanwhile,
        else fail every call and drop the connection."""
        self._timer = None
        if not self.deadlines:
            return
        if self._loop.time() < self.deadlines[0]:
            self._timer = self._loop.call_at(self.deadlines[0], self._expire)
            return
        self._fail_all(TimeoutError(f"no reply from Redis in {self._timeout_s:g} s"))
        if self.transport is not None:
            self.transport.abort()

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        while self.waiters:
            r = parse(self.buf, pos)
            if isinstance(r, _Incomplete):
                break
            value, pos = r
            fut = self.waiters.popleft()
            self.deadlines.popleft()
            if fut.done():  # the caller timed out or left
                continue
            if isinstance(value, ReplyError):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        if pos:
            del self.buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = exc or ConnectionError("redis closed the connection")
        self.transport = None
        self._fail_all(ConnectionError(str(self.lost)))

    def _fail_all(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.deadlines.clear()
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(exc)


class Script:
    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()  # noqa: S324 (Redis' id)


class RedisWire:
    """One pipelined connection to the Redis at ``url`` (redis:// or rediss://)."""

    def __init__(
        self, url: str, *, connect_timeout_s: float = 0.5, reply_timeout_s: float = 0.5
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}")
        self._host = parts.hostname or "localhost"
        self._port = parts.port or 6379
        self._tls = parts.scheme == "rediss"
        self._username = unquote(parts.username) if parts.username else None
        self._password = unquote(parts.password) if parts.password else None
        self._db = int(parts.path.lstrip("/") or 0)
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.transport is not None:
            return proto
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout_s):
            _, proto = await loop.create_connection(
                lambda: _Protocol(self._reply_timeout_s),
                self._host,
                self._port,
                ssl=ssl.create_default_context() if self._tls else None,
            )
            hello: list[list[bytes]] = []
            if self._password is not None:
                user = [self._username.encode()] if self._username else []
                hello.append([b"AUTH", *user, self._password.encode()])
            if self._db:
                hello.append([b"SELECT", str(self._db).encode()])
            futs = []
            for cmd in hello:
                fut: asyncio.Future[Reply] = loop.create_future()
                proto.send(encode(cmd), fut)
                futs.append(fut)
            try:
                for fut in futs:
                    await fut
            except BaseException:
                if proto.transport is not None:
                    proto.transport.close()
                raise
        self._proto = proto
        return proto

    async def call(self, *args: bytes) -> Reply:
        proto = await self._connection()
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        proto.send(encode(args), fut)
        return await fut

    async def evalsha(self, script: Script, keys: Sequence[bytes], args: Sequence[bytes]) -> Reply:
        cmd = (b"EVALSHA", script.sha, str(len(keys)).encode(), *keys, *args)
        try:
            return await self.call(*cmd)
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self.call(b"SCRIPT", b"LOAD", script.source)
        return await self.call(*cmd)

    def close(self) -> None:
        """Drop the connection (pending calls fail); the next call reconnects."""
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()
