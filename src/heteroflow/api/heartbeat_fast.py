"""``POST /api/v1/agent/heartbeat`` without the framework, when it succeeds.

Every node sends it every 5 s: it is most of what a fleet asks of a server. Through
FastAPI a heartbeat spent about as much of the server's one interpreter in the framework
(matching the path against the routes, twice; seven middlewares; the endpoint's own
machinery) as in its work (bench/control_plane.py, docs/benchmarks.md). Here the
dispatcher hands it straight to ``routes.nodes.heartbeat_work`` — the declared route's
work (``services.nodes``) for a batch of the beats that arrived together, in one trip to
a thread — and answers 200 with its reply, with the request id echoed and the latency
counted under the route's template, as ``ObserveMiddleware`` does.

Only the answer that succeeds is made here. A heartbeat the work declines (a wrong token,
a body that is not a JSON heartbeat) or that fails (the database: every beat of the
batch) is handed whole — its body replayed — to the API's declared route, which answers
it as it answers any other request: every error is FastAPI's own by construction, and a
heartbeat is only a refresh, so doing its work twice is harmless. The agents' machine calls are not
audited, so skipping the audit middleware changes nothing. A body larger than
``MAX_FAST_BODY`` also goes to the API.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from heteroflow.api.context import ServerContext
from heteroflow.api.observe import REQUEST_ID_HEADER
from heteroflow.logs import request_id
from heteroflow.services.metrics import ServerMetrics

log = logging.getLogger(__name__)

PATH = "/api/v1/agent/heartbeat"
MAX_FAST_BODY = 1 << 20  # a heartbeat is 1-10 KB; a larger one takes the general path
# Threads working on heartbeats, each on a batch: the beats that arrived while the
# threads were busy, at most MAX_BATCH, in arrival order. A batch costs one hand-off
# to a thread and one back to the event loop, one pooled connection, one read and an
# UPDATE statement or two (``services.nodes.refresh_many``) whatever its size, so a
# burst makes larger batches instead of a queue of hand-offs and statements; a beat
# that arrives alone is a batch of one, at once. (Per beat, through the shared thread
# pool, a burst at 2,000 agents once had 40 threads on 10 pooled connections: the pool
# opened and closed an overflow connection per heartbeat and the threads queued for
# the GIL — bench/control_plane.py.)
WORKERS = 2
MAX_BATCH = 64

ASGIApp = Any


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat request as the work gets it: its ASGI scope (with ``app``), its
    whole body and its request id."""

    scope: dict[str, Any]
    body: bytes
    request_id: str


Work = Callable[[ServerContext, Sequence[Beat]], "list[bytes | None]"]
_Waiting = tuple[Beat, "asyncio.Future[bytes | None]"]


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
        self._threads = ThreadPoolExecutor(WORKERS, thread_name_prefix="heartbeat")
        self._waiting: deque[_Waiting] = deque()
        self._lock = threading.Lock()  # guards _waiting's hand-over and _busy
        self._busy = 0  # threads taking batches

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        start = self.timer()
        body, more = await read_body(receive, MAX_FAST_BODY)
        if not more and len(body) <= MAX_FAST_BODY:
            sent = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
            rid = request_id(sent)
            reply = await self._submit(Beat({**scope, "app": self.app}, body, rid))
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

    def _submit(self, beat: Beat) -> asyncio.Future[bytes | None]:
        """The beat's reply, to come: it waits with the others for a thread."""
        done: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting.append((beat, done))
            start = self._busy < WORKERS
            self._busy += start
        if start:
            self._threads.submit(self._take_batches)
        return done

    def _take_batches(self) -> None:
        """In a thread: batches of the waiting beats until none is left; each batch is
        answered in one call to the event loop it came from."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._busy -= 1
                    return
                size = min(len(self._waiting), MAX_BATCH)
                batch = [self._waiting.popleft() for _ in range(size)]
            replies = self._try([beat for beat, _ in batch])
            loop = batch[0][1].get_loop()  # the server's one loop (a test may run two)
            if all(done.get_loop() is loop for _, done in batch):
                loop.call_soon_threadsafe(_answer, batch, replies)
            else:
                for one, reply in zip(batch, replies, strict=True):
                    one[1].get_loop().call_soon_threadsafe(_answer, [one], [reply])

    def _try(self, beats: list[Beat]) -> list[bytes | None]:
        """A reply per beat, or None: the API answers that one (a refusal, a failure)."""
        try:
            return self.work(self.ctx, beats)
        except Exception as exc:  # the API answers them, as it answers every error
            log.debug("%d heartbeats handed to the API: %s: %s", len(beats),
                      type(exc).__name__, exc)
            return [None] * len(beats)


def _answer(batch: list[_Waiting], replies: list[bytes | None]) -> None:
    """On the event loop: each beat of a batch gets its reply (unless its client left)."""
    for (_, done), reply in zip(batch, replies, strict=True):
        if not done.done():
            done.set_result(reply)


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
