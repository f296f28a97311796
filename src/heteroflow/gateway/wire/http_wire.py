"""HTTP/1.1 to model backends: the gateway's own keep-alive client for its hot path.

Why not aiohttp's client: measured on one core against the bench's fake engine, its
``session.post()`` + ``read()`` cost 0.106-0.109 ms of CPU per request, where this
client (an ``asyncio.Protocol`` with ``httptools``' llhttp response parser, the parser
uvicorn serves with) costs 0.034-0.038 ms — a fifth of the gateway's whole budget per
request (docs/benchmarks.md). What the gateway needs from a client is small and fixed:
POST/GET with a prepared body, keep-alive pooling per origin, a connect timeout, a
silence timeout while an answer is read, a relay of the body chunk by chunk with
back-pressure, and *exact* knowledge of whether a request left (failover and resends
depend on it: ``gateway.retry``). Owning the protocol gives the last one for free.

The failure classes, each a ``WireError`` (``nothing_sent`` says whether it is certain
that no byte of the request reached the backend):

* ``ConnectFailed`` / ``ConnectTimeout`` — no connection could be made (refused, no
  route, DNS, TLS handshake; or the connect timeout): nothing sent;
* ``Unwritten`` — the pooled connection was found closed by the peer before the request
  was written: nothing sent, and the caller may resend on a fresh connection;
* ``Disconnected`` — the connection closed (FIN or reset) after the request was
  written, before the answer was complete (a backend that died, or one that closed an
  idle connection as it was reused: the two cannot be told apart). ``unanswered`` says
  whether no byte of an answer had arrived by then: the backend may have read the
  request, but it provably answered nothing (the gateway may then send the request to
  *another* backend once, ``gateway.retry``); any byte of the answer, and it is a partial
  answer that is never sent again;
* ``ReadTimeout`` (a ``TimeoutError``) — the backend was silent for ``read_timeout_s``
  while an answer was due;
* ``BadAnswer`` — what came back was not an HTTP/1.1 answer llhttp could read.

Idle connections are kept per origin (scheme, host, port), newest first, for at most
``keepalive_s`` (shorter than the engines' own 5 s keep-alive, so that we rarely reuse one
the backend is closing); a connection whose answer said ``Connection: close``, was not
read to its end, or failed is never pooled.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

# A streamed answer buffered beyond this (a client slower than the engine) pauses
# reading from the backend until the relay catches up: TCP's window does the rest.
_HIGH_WATER = 256 * 1024
_SMALL_BODY = 64 * 1024  # at or below: head and body leave in one write (one syscall)
_TARGET_CACHE_MAX = 4096


class WireError(Exception):
    """A request to a backend failed; ``nothing_sent``: no byte of it can have arrived;
    ``unanswered``: the connection ended before any byte of an answer arrived (it may
    have been read: only a ``Disconnected`` can say so, a silence never does)."""

    nothing_sent = False
    unanswered = False


class ConnectFailed(WireError):
    """No connection could be made (refused, unreachable, DNS, TLS handshake)."""

    nothing_sent = True

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConnectTimeout(WireError, TimeoutError):
    """The connection was not made within the connect timeout."""

    nothing_sent = True


class Unwritten(WireError):
    """The pooled connection was closed by the peer before the request was written."""

    nothing_sent = True


class Disconnected(WireError):
    """The connection closed after the request was written, before the answer ended."""

    def __init__(self, reason: str, *, unanswered: bool = False) -> None:
        super().__init__(reason)
        self.unanswered = unanswered


class ReadTimeout(WireError, TimeoutError):
    """The backend was silent for the read timeout while an answer was due."""


class BadAnswer(WireError):
    """The backend's bytes were not an HTTP/1.1 answer."""


class _Target(NamedTuple):
    origin: tuple[str, str, int]  # scheme, host, port: the pool's key
    host_header: bytes
    target: bytes  # path and query, as sent on the request line


class Headers:
    """A response's headers by name, case-insensitive (the first of repeated names)."""

    __slots__ = ("_by_name", "_raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw
        self._by_name: dict[str, str] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        by_name = self._by_name
        if by_name is None:
            by_name = {}
            for n, v in self._raw:
                by_name.setdefault(n.decode("latin-1").lower(), v.decode("latin-1"))
            self._by_name = by_name
        return by_name.get(name.lower(), default)


class Response:
    """One backend answer: its status and headers once ``request()`` returns, its body
    through ``read()`` (whole) or ``iter_any()`` (as it arrives). End it with
    ``release()`` (the connection goes back to the pool when the answer was read to its
    end and may be kept) or ``close()`` (the connection is dropped: an answer left
    unfinished, which also tells the backend to stop generating)."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_error",
        "_headers",
        "_pool",
        "_size",
        "_waiter",
        "_whole",
        "complete",
        "ended",
        "headers_done",
        "keep",
        "raw_headers",
        "status",
    )

    def __init__(self, conn: _Conn, pool: Pool, keep: bool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: Headers | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: WireError | None = None
        self._whole = False  # read() holds the whole body: no back-pressure then
        self.headers_done = False
        self.complete = False
        self.keep = keep  # False: never pooled afterwards (the caller may set it)
        self.ended = False  # released or closed

    # -- what the relay reads
    @property
    def headers(self) -> Headers:
        if self._headers is None:
            self._headers = Headers(self.raw_headers)
        return self._headers

    @property
    def content_type(self) -> str:
        ctype = self.headers.get("Content-Type") or ""
        return ctype.partition(";")[0].strip().lower()

    async def read(self) -> bytes:
        """The whole body (no back-pressure: the answer is held whole anyway)."""
        self._whole = True
        self._conn.resume()
        while not self.complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything buffered at each step, joined."""
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._size = 0
                self._conn.resume()
                yield data
                continue
            if self.complete:
                return
            if self._error is not None:
                raise self._error
            await self._wait()

    def release(self) -> None:
        """Done with the answer: pool the connection if it can serve another request."""
        if self.ended:
            return
        self.ended = True
        conn = self._conn
        conn.resp = None
        if self.complete and self.keep and self._error is None and conn.reusable():
            self._pool.put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Drop the connection (an unfinished answer must never be pooled)."""
        if self.ended:
            return
        self.ended = True
        self._conn.resp = None
        self._conn.abort()

    # -- what the connection feeds
    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER and not self._whole:
            self._conn.pause()
        self._wake()

    def _fail(self, error: WireError) -> None:
        if self._error is None and not self.complete:
            self._error = error
            self._wake()


class _Conn(asyncio.Protocol):
    """One connection to a backend, carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: tuple[str, str, int]) -> None:
        self._loop = loop
        self.origin = origin
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.resp: Response | None = None
        self.lost = False
        self.idle_since = 0.0
        self._keep_alive = True
        self._paused = False
        self._last = 0.0  # the loop time of the last byte (the silence timer's start)
        self._timeout_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._framed = False  # the answer has a Content-Length or is chunked
        self._heard = False  # a byte of the current request's answer arrived

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.complete:  # bytes nobody asked for: not a sane backend
            self.abort()
            return
        self._last = self._loop.time()
        self._heard = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(BadAnswer(f"unreadable answer: {exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._stop_timer()
        resp = self.resp
        if resp is None or resp.complete:
            return
        if resp.headers_done and not self._framed and exc is None:
            # a body delimited by the connection's end (HTTP/1.0 style): complete now
            self._end_message(resp)
            return
        if self._heard:
            resp._fail(Disconnected("the backend closed the connection mid-answer"))
        else:
            resp._fail(Disconnected("the backend closed before answering", unanswered=True))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        if resp is not None and not resp.headers_done:
            resp.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:  # 1xx (100-continue we never asked for): the real one follows
            resp.raw_headers.clear()
            return
        resp.status = status
        self._keep_alive = parser.should_keep_alive()
        self._framed = any(
            n.lower() in (b"content-length", b"transfer-encoding") for n, _ in resp.raw_headers
        ) or status in (204, 304)
        resp.headers_done = True
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is not None and resp.headers_done:
            self._end_message(resp)

    # -- the request's life
    def send(self, resp: Response, data: bytes, body: bytes, timeout_s: float) -> None:
        transport = self.transport
        assert transport is not None
        if self.lost or transport.is_closing():
            raise Unwritten("the pooled connection was closed before the request was written")
        self.resp = resp
        self._keep_alive = True
        self._framed = False
        self._heard = False
        self._timeout_s = timeout_s
        now = self._last = self._loop.time()
        self._timer = self._loop.call_at(now + timeout_s, self._check_silence)
        if len(body) <= _SMALL_BODY:
            transport.write(data + body)
        else:
            transport.write(data)
            transport.write(body)

    def _end_message(self, resp: Response) -> None:
        self._stop_timer()
        resp.complete = True
        resp._wake()

    def _check_silence(self) -> None:
        self._timer = None
        resp = self.resp
        if resp is None or resp.complete or self.lost:
            return
        now = self._loop.time()
        if self._paused:  # we stopped reading (the client is slow, not the backend)
            self._timer = self._loop.call_at(now + self._timeout_s, self._check_silence)
            return
        if now < self._last + self._timeout_s:  # bytes came meanwhile: from the last one
            self._timer = self._loop.call_at(self._last + self._timeout_s, self._check_silence)
            return
        resp._fail(ReadTimeout(f"no answer from the backend in {self._timeout_s:g} s"))
        self.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def reusable(self) -> bool:
        return self._keep_alive and not self.lost and not self._paused

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.lost:
                self.transport.resume_reading()

    def abort(self) -> None:
        self._stop_timer()
        if self.transport is not None and not self.lost:
            self.transport.abort()


class Pool:
    """Keep-alive connections to backends, per origin, for one event loop."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_s: float,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        self._ssl: ssl.SSLContext | None = None  # made at the first https backend
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._targets: dict[str, _Target] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    async def request(
        self,
        method: bytes,
        url: str,
        body: bytes = b"",
        headers: bytes = b"",
        *,
        fresh: bool = False,
        read_timeout_s: float | None = None,
    ) -> Response:
        """Send one request and return its answer once the status and headers are read.

        ``headers``: ready header lines (``Name: value\\r\\n`` each; ``header()`` makes
        one). ``fresh``: on a new connection, never pooled afterwards (for a resend).
        Raises a ``WireError``; a cancelled caller drops the connection (the backend
        sees the client leave).
        """
        t = self._target(url)
        loop = asyncio.get_running_loop()
        conn = None if fresh else self._checkout(t.origin, loop.time())
        if conn is None:
            conn = await self._connect(loop, t.origin)
        resp = Response(conn, self, keep=not fresh)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            method,
            t.target,
            t.host_header,
            len(body),
            headers,
        )
        conn.send(resp, head, body, read_timeout_s or self._read_timeout_s)
        try:
            while not resp.headers_done:
                if resp._error is not None:
                    raise resp._error
                await resp._wait()
        except BaseException:
            resp.close()
            raise
        return resp

    def put(self, conn: _Conn) -> None:
        """A connection whose answer ended, back into the pool."""
        if self._closed:
            conn.abort()
            return
        loop = conn._loop
        conn.idle_since = loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._sweep is None:
            self._sweep = loop.call_later(self._keepalive_s, self._expire)

    def _checkout(self, origin: tuple[str, str, int], now: float) -> _Conn | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the newest: the least likely to be closing
            transport = conn.transport
            if conn.lost or transport is None or transport.is_closing():
                continue
            if now - conn.idle_since >= self._keepalive_s:
                conn.abort()
                continue
            return conn
        return None

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, origin: tuple[str, str, int]
    ) -> _Conn:
        scheme, host, port = origin
        tls = scheme == "https"
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, origin),
                    host,
                    port,
                    ssl=self._ssl if tls else None,
                    server_hostname=host if tls else None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"no connection to {host}:{port} in {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:  # refused, unreachable, DNS (gaierror), TLS (SSLError)
            reason = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            raise ConnectFailed(reason) from exc
        return conn

    def _expire(self) -> None:
        """Close connections idle for the keep-alive time; again while any is idle."""
        self._sweep = None
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        cutoff = loop.time() - self._keepalive_s
        for origin in list(self._idle):
            kept = []
            for conn in self._idle[origin]:
                if conn.lost:
                    continue
                if conn.idle_since <= cutoff:
                    conn.abort()
                else:
                    kept.append(conn)
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]
        if self._idle:
            self._sweep = loop.call_later(self._keepalive_s / 2, self._expire)

    def _target(self, url: str) -> _Target:
        t = self._targets.get(url)
        if t is None:
            t = _split(url)
            if len(self._targets) >= _TARGET_CACHE_MAX:
                self._targets.clear()
            self._targets[url] = t
        return t

    def retain(self, base_urls: Iterable[str]) -> None:
        """Close the idle connections to origins none of ``base_urls`` has."""
        live = {_split(u).origin for u in base_urls}
        for origin in [o for o in self._idle if o not in live]:
            for conn in self._idle.pop(origin):
                conn.abort()
        self._targets.clear()

    def close(self) -> None:
        """Close every idle connection; answers in flight close their own."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()


def header(name: str, value: str) -> bytes:
    """One header line; a value with a line break would forge headers and is refused."""
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"header {name!r}: a line break or a colon in the wrong place")
    return f"{name}: {value}\r\n".encode("latin-1")


def _split(url: str) -> _Target:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if scheme == "https" else 80)
    host = parts.hostname
    default_port = port == (443 if scheme == "https" else 80)
    shown = f"[{host}]" if ":" in host else host.encode("idna").decode("ascii")
    host_header = shown if default_port else f"{shown}:{port}"
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return _Target((scheme, host, port), host_header.encode("ascii"), target.encode("latin-1"))
