"""``POST /api/v1/agent/heartbeat`` without the framework, when it succeeds.

Every node sends it every 5 s: it is most of what a fleet asks of a server. Through
FastAPI a heartbeat spent about as much of the server's one interpreter in the framework
(matching the path against the routes, twice; seven middlewares; the endpoint's own
machinery) as in its work (bench/control_plane.py, docs/benchmarks.md). Here the
dispatcher hands it straight to ``routes.nodes.heartbeat_work`` — the declared route's
work (``services.nodes.heartbeat``) in one trip to the thread pool — and answers 200
with its reply, with the request id echoed and the latency counted under the route's
template, as ``ObserveMiddleware`` does.

Only the answer that succeeds is made here. A heartbeat the work declines (a wrong token,
a body that is not a JSON heartbeat) or that fails (the database) is handed whole — its
body replayed — to the API's declared route, which answers it as it answers any other
request: every error is FastAPI's own by construction, and a heartbeat is only a
refresh, so doing its work twice is harmless. The agents' machine calls are not
audited, so skipping the audit middleware changes nothing. A body larger than
``MAX_FAST_BODY`` also goes to the API.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import Request

from heteroflow.api.context import ServerContext
from heteroflow.api.observe import REQUEST_ID_HEADER
from heteroflow.logs import REQUEST_ID, request_id
from heteroflow.services.metrics import ServerMetrics

log = logging.getLogger(__name__)

PATH = "/api/v1/agent/heartbeat"
MAX_FAST_BODY = 1 << 20  # a heartbeat is 1-10 KB; a larger one takes the general path
# Heartbeats worked on at once, on threads of their own. Each holds a pooled database
# connection for its work; through the shared thread pool (40 threads) a burst at 2,000
# agents had 40 at once for 10 pooled connections: the pool opened and closed an
# overflow connection per heartbeat (a PostgreSQL backend each) and 40 threads queued
# for the GIL, and one server answered ~190 a second at half a core
# (bench/control_plane.py). The rest wait in the executor's queue, which costs the event
# loop nothing (anyio's capacity limiter costs more the more wait on it).
CONCURRENCY = 6

ASGIApp = Any
Work = Callable[[Request, ServerContext, bytes], "bytes | None"]


class HeartbeatFastPath:
    def __init__(
        self,
        api: ASGIApp,
        ctx: ServerContext,
        work: Work,
        metrics: ServerMetrics | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.api = api  # the FastAPI app: every answer but a success
        self.app = api  # what ``request.app`` is to the work (its state: the node tokens)
        self.ctx = ctx
        self.work = work
        self.metrics = metrics
        self.timer = timer
        self._threads = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="heartbeat")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        start = self.timer()
        body, more = await read_body(receive, MAX_FAST_BODY)
        if not more and len(body) <= MAX_FAST_BODY:
            sent = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
            rid = request_id(sent)
            token = REQUEST_ID.set(rid)
            try:
                context = contextvars.copy_context()  # the request id, in the thread
                reply = await asyncio.get_running_loop().run_in_executor(
                    self._threads, context.run, self._try, scope, body
                )
            finally:
                REQUEST_ID.reset(token)
            if reply is not None:
                await send({
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(reply)),
                        (REQUEST_ID_HEADER, rid.encode("ascii")),
                    ],
                })
                await send({"type": "http.response.body", "body": reply})
                if self.metrics is not None:
                    self.metrics.api_request("POST", PATH, 200, self.timer() - start)
                return
        await self.api(scope, replayed(body, more, receive), send)

    def close(self) -> None:
        """After the server stopped serving: its threads end (none is working then)."""
        self._threads.shutdown(wait=False)

    def _try(self, scope: dict[str, Any], body: bytes) -> bytes | None:
        """The reply, or None: the API answers this one (a refusal or a failure)."""
        scope = {**scope, "app": self.app}
        try:
            return self.work(Request(scope), self.ctx, body)
        except Exception as exc:  # the API answers it, as it answers every error
            log.debug("heartbeat handed to the API: %s: %s", type(exc).__name__, exc)
            return None


async def read_body(receive: Any, limit: int) -> tuple[bytes, bool]:
    """The body, read until it ends or passes ``limit`` bytes, and whether more is to
    come (also when the client left: the API then sees that too)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), True
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False
        if size > limit:
            return b"".join(chunks), True


def replayed(body: bytes, more: bool, receive: Any) -> Any:
    """A ``receive`` that gives what was read first, then what is left."""
    first = True

    async def again() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": more}
        message: dict[str, Any] = await receive()  # the rest of the body, or the disconnect
        return message

    return again
