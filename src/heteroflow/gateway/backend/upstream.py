"""Connections to model backends: the pooled client, the /v1/models cache, resends.

Owns everything the gateway does on the wire towards engines, so that ``app`` only
routes and relays:

* one ``http_wire.Pool`` per event loop, created on first use: keep-alive connections
  per origin with no limit (a gateway must never queue requests behind a pool limit),
  a connect timeout, and a silence timeout while an answer is due;
* ``open()``: send one request, mapping failures to OpenAI-shaped 502/504 errors,
  marked when no byte of the request left (the connection could not be made, or a
  pooled one was found closed before the write) or when the connection ended before
  any byte of an answer (the app may send the request to another backend, see
  ``gateway.retry``); resent once, on a fresh connection to the same backend, only
  when the pooled connection was found closed before the write (``http_wire.Unwritten``);
* connection hygiene: llama.cpp's server (cpp-httplib) closes the connection after
  every streamed answer although its headers promise keep-alive
  (``Keep-Alive: timeout=5, max=100``). Pooled, the next request on it fails (the 502s
  of issue 15, item 8). So a stream request to a backend known to be llama.cpp (its
  ``Server`` header, seen on the /v1/models lookup that precedes the first request, or
  on a streamed answer) says ``Connection: close`` up front, and the first streamed
  answer that reveals one is never pooled;
* the same recognition decides ``assembles()``: llama.cpp stops a generation when a
  stream's connection closes but never a non-stream one's, so the app sends its
  non-stream generations as streams and assembles the answer (``assemble``);
* ``model_ids()``: each backend's ``GET /v1/models`` answer, cached for a TTL,
  refreshed in the background once stale, and looked up once per backend at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.http_wire import (
    ConnectFailed,
    Pool,
    ReadTimeout,
    Response,
    Unwritten,
    WireError,
    header,
)
from heteroflow.schemas.routing import Backend

logger = logging.getLogger(__name__)

# uvicorn (so vLLM) and llama.cpp close idle keep-alive connections after 5 s; dropping
# ours sooner means we rarely send on a connection the backend is closing. What is left
# of that race is resent when provably unwritten (``open``); once written, it cannot be
# told from a backend that read the request and died: never resent to the same backend,
# sent once to another when nothing of an answer came back (``gateway.retry``).
_KEEPALIVE_S = 4.0
_MODELS_LOOKUP_TIMEOUT_S = 10.0
_FORWARD_HEADERS = b"Content-Type: application/json\r\n"
REQUEST_ID_HEADER = "X-Request-Id"  # the gateway's request id, for the engine's logs
# Engines whose server closes the connection after a streamed (SSE) answer: the
# ``Server`` header's value starts with one of these.
_CLOSES_AFTER_STREAM = ("llama.cpp",)
_CLOSE = b"Connection: close\r\n"


class UpstreamFailure(NamedTuple):
    """Why ``open()`` got no response: the error to answer, whether it is certain that
    no byte of the request left (the connection could not be made), and whether the
    connection ended before any byte of an answer came back (``gateway.retry``)."""

    error: errors.OpenAIError
    nothing_sent: bool
    unanswered: bool = False


@dataclass(frozen=True, slots=True)
class BackendModels:
    """One backend's model ids as served by its /v1/models, in the backend's order."""

    ids: frozenset[str]
    first: str | None
    expires: float  # time.monotonic() deadline


class _LoopState:
    """What must not cross event loops: the connection pool and the lookup tasks."""

    __slots__ = ("lookups", "pool")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.lookups: dict[str, asyncio.Task[BackendModels | None]] = {}


class Upstream:
    def __init__(
        self, *, models_cache_ttl_s: float, upstream_timeout_s: float, connect_timeout_s: float
    ) -> None:
        self._ttl = models_cache_ttl_s
        # A silence timeout, not a total one: a stream may run for an hour; what must not
        # pass upstream_timeout_s is the silence before the next byte (or the whole answer
        # of a non-stream request, which arrives at once).
        self._read_timeout_s = upstream_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._states: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._models: dict[str, BackendModels] = {}  # base_url -> ids (plain data)
        self._failing: set[str] = set()  # base_urls whose last lookup failed (log once)
        # base_urls that close after an SSE answer (llama.cpp): also ``assembles()``
        self._closes_streams: set[str] = set()

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        st = self._states.get(loop)
        if st is None:
            for old in [lp for lp in self._states if lp.is_closed()]:
                del self._states[old]
            pool = Pool(
                connect_timeout_s=self._connect_timeout_s,
                read_timeout_s=self._read_timeout_s,
                keepalive_s=_KEEPALIVE_S,
            )
            st = self._states[loop] = _LoopState(pool)
        return st

    def _headers(self, backend: Backend, request_id: str, close: bool) -> bytes:
        lines = _FORWARD_HEADERS
        if backend.auth:  # an external backend's own key (routing file)
            lines += header("Authorization", backend.auth)
        if request_id:
            lines += header(REQUEST_ID_HEADER, request_id)
        if close:
            lines += _CLOSE
        return lines

    async def open(
        self, url: str, body: bytes, backend: Backend, request_id: str = "", stream: bool = False
    ) -> Response | UpstreamFailure:
        """POST ``body`` to ``url``; the response (headers read) or why there is none.

        Resent only when provably unwritten (a pooled connection found closed before the
        request was written: ``http_wire.Unwritten``), once, on a fresh connection.
        Otherwise never: once the request may have been written, a second send could run
        a generation twice (issue 10). A connection that could not be made (nothing
        sent), or that ended before any byte of an answer (``unanswered``), is marked
        so the app may try another backend.
        """
        pool = self._state().pool
        close = stream and backend.base_url in self._closes_streams
        headers = self._headers(backend, request_id, close)
        try:
            try:
                resp = await pool.request(b"POST", url, body, headers)
            except Unwritten:
                logger.debug("backend %s: pooled connection was closed; resent", backend.base_url)
                resp = await pool.request(b"POST", url, body, headers, fresh=True)
        except WireError as exc:
            return _failure(exc, backend)
        if (
            not close
            and resp.content_type == "text/event-stream"
            and self._note_server(backend.base_url, resp)
        ):
            resp.keep = False  # the first stream that says llama.cpp: never pooled
        return resp

    def assembles(self, base_url: str) -> bool:
        """Whether a non-stream chat/completions request to ``base_url`` goes upstream as
        a stream whose events the relay assembles (``assemble``): a llama.cpp backend,
        which decodes a non-stream request to ``max_tokens`` after its client left, but
        stops a stream at once (issue 15, item 6)."""
        return base_url in self._closes_streams

    def _note_server(self, base_url: str, resp: Response) -> bool:
        """Remember whether ``base_url`` closes its connection after a stream."""
        if (resp.headers.get("Server") or "").startswith(_CLOSES_AFTER_STREAM):
            self._closes_streams.add(base_url)
            return True
        return False

    async def model_ids(self, base_url: str, auth: str = "") -> BackendModels | None:
        """The backend's model ids, or None when they have never been obtained.

        A fresh entry is returned at once; a stale one is returned too while one
        background lookup refreshes it; with no entry the caller waits for the lookup.
        """
        st = self._state()
        cached = self._models.get(base_url)
        if cached is not None:
            if cached.expires <= time.monotonic() and base_url not in st.lookups:
                self._start_lookup(st, base_url, auth)
            return cached
        task = st.lookups.get(base_url) or self._start_lookup(st, base_url, auth)
        # Shielded: one cancelled client must not cancel the lookup others wait for.
        return await asyncio.shield(task)

    def _start_lookup(
        self, st: _LoopState, base_url: str, auth: str = ""
    ) -> asyncio.Task[BackendModels | None]:
        task = asyncio.get_running_loop().create_task(self._lookup(st.pool, base_url, auth))
        st.lookups[base_url] = task
        task.add_done_callback(lambda _t: st.lookups.pop(base_url, None))
        return task

    async def _lookup(self, pool: Pool, base_url: str, auth: str = "") -> BackendModels | None:
        headers = header("Authorization", auth) if auth else b""
        try:
            async with asyncio.timeout(_MODELS_LOOKUP_TIMEOUT_S):
                r = await pool.request(
                    b"GET",
                    base_url + "/v1/models",
                    headers=headers,
                    read_timeout_s=_MODELS_LOOKUP_TIMEOUT_S,
                )
                try:
                    raw = await r.read()
                except BaseException:
                    r.close()
                    raise
                r.release()
            self._note_server(base_url, r)
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}")
            data = orjson.loads(raw)["data"]
            ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (WireError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            # Not cached: the next request tries again. A stale entry, if any, stays.
            level = logging.DEBUG if base_url in self._failing else logging.WARNING
            logger.log(
                level, "backend %s: /v1/models lookup failed: %s", base_url, type(exc).__name__
            )
            self._failing.add(base_url)
            return self._models.get(base_url)
        self._failing.discard(base_url)
        entry = BackendModels(frozenset(ids), ids[0] if ids else None, time.monotonic() + self._ttl)
        self._models[base_url] = entry
        return entry

    def retain(self, live_base_urls: Iterable[str]) -> None:
        """Forget cached model ids and idle connections of backends that left the routing
        snapshot."""
        live = set(live_base_urls)
        for url in [u for u in self._models if u not in live]:
            del self._models[url]
        self._failing &= live
        self._closes_streams &= live
        for st in self._states.values():
            st.pool.retain(live)

    async def aclose(self) -> None:
        """Close every pool's idle connections and cancel the lookups in flight."""
        states, self._states = self._states, {}
        current = asyncio.get_running_loop()
        for loop, st in states.items():
            if loop is current:
                _close_state(st)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(_close_state, st)


def _failure(exc: WireError, backend: Backend) -> UpstreamFailure:
    """The error to answer for ``exc``, logged once per failed request."""
    where = f"backend {backend.base_url} (task {backend.task_id})"
    if isinstance(exc, ConnectFailed):
        logger.warning("%s: cannot connect: %s", where, exc.reason)
    elif exc.nothing_sent:  # the connect timeout, or a resend that found no connection
        logger.warning("%s: cannot connect: %s", where, exc)
    elif isinstance(exc, ReadTimeout):
        logger.warning("%s: timed out", where)
    elif exc.unanswered:
        logger.warning("%s: connection lost before any answer", where)
    else:
        logger.warning("%s: connection lost: %s", where, type(exc).__name__)
    timed_out = isinstance(exc, TimeoutError)
    error = errors.upstream_timeout() if timed_out else errors.upstream_error()
    return UpstreamFailure(error, exc.nothing_sent, exc.unanswered)


def _close_state(st: _LoopState) -> None:
    for task in list(st.lookups.values()):
        task.cancel()
    st.pool.close()
