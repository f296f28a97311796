"""Connections to model backends: pooled aiohttp sessions, the /v1/models cache, retries.

Owns everything the gateway does on the wire towards engines, so that ``app`` only
routes and relays:

* one ``aiohttp.ClientSession`` per event loop, created on first use, with an unlimited
  keep-alive pool (a gateway must never queue requests behind a pool limit);
* ``open()``: send one request, mapping failures to OpenAI-shaped 502/504 errors,
  marked when the connection itself failed (nothing was sent: the app may send the
  request to another backend, see ``gateway.retry``); resent once, on a fresh
  connection to the same backend, only when a pooled connection turned out closed
  before the request could be written (``retry.request_unwritten``);
* connection hygiene: llama.cpp's server (cpp-httplib) closes the connection after
  every streamed answer although its headers promise keep-alive
  (``Keep-Alive: timeout=5, max=100``). Pooled, the next request on it fails (the 502s
  of issue 15, item 8). Closing the response afterwards is too late — aiohttp pools a
  connection the moment it reads the body's end, which for a short stream happens
  before ``post()`` even returns — so a stream request to a backend known to be
  llama.cpp (its ``Server`` header, seen on the /v1/models lookup that precedes the
  first request, or on a streamed answer) says ``Connection: close`` up front;
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

import aiohttp
import orjson

from heteroflow.gateway import errors
from heteroflow.gateway.retry import NOTHING_SENT, request_unwritten
from heteroflow.schemas.routing import Backend

logger = logging.getLogger(__name__)

# uvicorn (so vLLM) and llama.cpp close idle keep-alive connections after 5 s; dropping
# ours sooner means we rarely send on a connection the backend is closing. What is left
# of that race is resent when provably unwritten (``open``), else answered 502, which
# OpenAI's SDKs retry: a resend could not tell it from a backend that read the request
# and died, and would run a generation twice.
_KEEPALIVE_S = 4.0
_MODELS_LOOKUP_TIMEOUT_S = 10.0
_FORWARD_HEADERS = {"Content-Type": "application/json"}
REQUEST_ID_HEADER = "X-Request-Id"  # the gateway's request id, for the engine's logs
# Engines whose server closes the connection after a streamed (SSE) answer: the
# ``Server`` header's value starts with one of these.
_CLOSES_AFTER_STREAM = ("llama.cpp",)
_CLOSE = {"Connection": "close"}
# The connection closed or was reset before any byte of the response arrived: a backend
# that read the request and died, or (rarely) a keep-alive connection it closed as we
# reused it. Not proof that nothing was sent: never resent, never failed over.
_LOST_ERRORS = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ClientOSError,
)


class UpstreamFailure(NamedTuple):
    """Why ``open()`` got no response: the error to answer, and whether it is certain
    that no byte of the request left (the connection could not be made)."""

    error: errors.OpenAIError
    nothing_sent: bool


@dataclass(frozen=True, slots=True)
class BackendModels:
    """One backend's model ids as served by its /v1/models, in the backend's order."""

    ids: frozenset[str]
    first: str | None
    expires: float  # time.monotonic() deadline


class _LoopState:
    """What must not cross event loops: the session and the lookup tasks."""

    __slots__ = ("fresh", "lookups", "session")

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.fresh: aiohttp.ClientSession | None = None  # never pooled: for resends
        self.lookups: dict[str, asyncio.Task[BackendModels | None]] = {}


class Upstream:
    def __init__(
        self, *, models_cache_ttl_s: float, upstream_timeout_s: float, connect_timeout_s: float
    ) -> None:
        self._ttl = models_cache_ttl_s
        # sock_read, not total: a stream may run for an hour; what must not pass
        # upstream_timeout_s is the silence before the next byte (or the whole answer of
        # a non-stream request, which arrives at once).
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=upstream_timeout_s
        )
        self._lookup_timeout = aiohttp.ClientTimeout(
            total=_MODELS_LOOKUP_TIMEOUT_S, sock_connect=connect_timeout_s
        )
        self._states: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._models: dict[str, BackendModels] = {}  # base_url -> ids (plain data)
        self._failing: set[str] = set()  # base_urls whose last lookup failed (log once)
        # base_urls that close after an SSE answer (llama.cpp): also ``assembles()``
        self._closes_streams: set[str] = set()

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        st = self._states.get(loop)
        if st is None or st.session.closed:
            for old in [lp for lp in self._states if lp.is_closed()]:
                del self._states[old]
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S, ttl_dns_cache=300
            )
            st = self._states[loop] = _LoopState(self._session(connector))
        return st

    def _session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            # Bytes are relayed untouched: never ask for or undo a content-encoding.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    def _fresh(self, st: _LoopState) -> aiohttp.ClientSession:
        """A session that never reuses a connection (only resends take it)."""
        if st.fresh is None or st.fresh.closed:
            st.fresh = self._session(aiohttp.TCPConnector(limit=0, force_close=True))
        return st.fresh

    async def open(
        self, url: str, body: bytes, backend: Backend, request_id: str = "", stream: bool = False
    ) -> aiohttp.ClientResponse | UpstreamFailure:
        """POST ``body`` to ``url``; the response (headers read) or why there is none.

        Resent only when provably unwritten (a pooled connection found closed as the
        request was handed to it: ``retry.request_unwritten``), once, on a fresh
        connection. Otherwise never: once the request may have been written, a second
        send could run a generation twice (issue 10). A connection that could not be made
        (nothing sent) is marked so the app may try another backend.
        """
        st = self._state()
        headers = _FORWARD_HEADERS
        close = stream and backend.base_url in self._closes_streams
        if backend.auth or request_id or close:
            headers = {**headers}
            if backend.auth:  # an external backend's own key (routing file)
                headers["Authorization"] = backend.auth
            if request_id:
                headers[REQUEST_ID_HEADER] = request_id
            if close:
                headers.update(_CLOSE)
        try:
            try:
                resp = await st.session.post(url, data=body, headers=headers)
            except (aiohttp.ClientOSError, aiohttp.ClientConnectionResetError) as exc:
                if not request_unwritten(exc):
                    raise
                logger.debug("backend %s: pooled connection was closed; resent", backend.base_url)
                resp = await self._fresh(st).post(url, data=body, headers=headers)
        except NOTHING_SENT as exc:
            # refused, unreachable, DNS, TLS, connect timeout: nothing was sent
            logger.warning(
                "backend %s (task %s): cannot connect: %s",
                backend.base_url,
                backend.task_id,
                _connect_reason(exc),
            )
            timed_out = isinstance(exc, TimeoutError)
            error = errors.upstream_timeout() if timed_out else errors.upstream_error()
            return UpstreamFailure(error, True)
        except TimeoutError:
            logger.warning("backend %s (task %s): timed out", backend.base_url, backend.task_id)
            return UpstreamFailure(errors.upstream_timeout(), False)
        except _LOST_ERRORS as exc:
            logger.warning(
                "backend %s (task %s): connection lost: %s",
                backend.base_url,
                backend.task_id,
                type(exc).__name__,
            )
            return UpstreamFailure(errors.upstream_error(), False)
        except aiohttp.ClientError as exc:
            logger.warning(
                "backend %s (task %s): %s", backend.base_url, backend.task_id, type(exc).__name__
            )
            return UpstreamFailure(errors.upstream_error(), False)
        if not close and resp.content_type == "text/event-stream" and self._note_server(
            backend.base_url, resp
        ):
            _never_pool(resp)  # the first stream: in time only if its end is still unread
        return resp

    def assembles(self, base_url: str) -> bool:
        """Whether a non-stream chat/completions request to ``base_url`` goes upstream as
        a stream whose events the relay assembles (``assemble``): a llama.cpp backend,
        which decodes a non-stream request to ``max_tokens`` after its client left, but
        stops a stream at once (issue 15, item 6)."""
        return base_url in self._closes_streams

    def _note_server(self, base_url: str, resp: aiohttp.ClientResponse) -> bool:
        """Remember whether ``base_url`` closes its connection after a stream."""
        if resp.headers.get("Server", "").startswith(_CLOSES_AFTER_STREAM):
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
        task = asyncio.get_running_loop().create_task(self._lookup(st.session, base_url, auth))
        st.lookups[base_url] = task
        task.add_done_callback(lambda _t: st.lookups.pop(base_url, None))
        return task

    async def _lookup(
        self, session: aiohttp.ClientSession, base_url: str, auth: str = ""
    ) -> BackendModels | None:
        headers = {"Authorization": auth} if auth else None
        try:
            async with session.get(
                base_url + "/v1/models", timeout=self._lookup_timeout, headers=headers
            ) as r:
                raw = await r.read()
                self._note_server(base_url, r)
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
            data = orjson.loads(raw)["data"]
            ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
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
        """Forget cached model ids of backends that left the routing snapshot."""
        live = set(live_base_urls)
        for url in [u for u in self._models if u not in live]:
            del self._models[url]
        self._failing &= live
        self._closes_streams &= live

    async def aclose(self) -> None:
        """Close every session; the one of the running loop is awaited."""
        states, self._states = self._states, {}
        current = asyncio.get_running_loop()
        for loop, st in states.items():
            if loop is current:
                await _close_state(st)
            elif not loop.is_closed():
                asyncio.run_coroutine_threadsafe(_close_state(st), loop)


def _connect_reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.strerror or type(exc).__name__
    return "connect timed out"


def _never_pool(resp: aiohttp.ClientResponse) -> None:
    """Close ``resp``'s connection once the answer is read, instead of pooling it
    (aiohttp pools a connection as soon as the body's end is read, so closing the
    response after that is too late)."""
    conn = resp.connection
    if conn is not None and conn.protocol is not None:
        conn.protocol.force_close()


async def _close_state(st: _LoopState) -> None:
    for task in list(st.lookups.values()):
        task.cancel()
    await st.session.close()
    if st.fresh is not None:
        await st.fresh.close()
