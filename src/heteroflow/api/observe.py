"""Request ids and latency of the management API (P3): a pure ASGI wrapper.

Every request gets an id — the caller's ``x-request-id`` when usable (printable ASCII,
at most 128 characters; the gateway's rule, ``logs.request_id``), else a new
``req_<hex>`` — echoed on the answer and set in ``logs.REQUEST_ID`` while it is answered,
so its log lines carry it. Its time, from the call to the end of the ASGI call, is
counted in ``ServerMetrics`` under the route's template (Starlette leaves the matched
route in the scope), never the raw path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heteroflow.logs import REQUEST_ID, request_id
from heteroflow.services.metrics import OTHER, ServerMetrics

REQUEST_ID_HEADER = b"x-request-id"


def route_label(scope: Scope) -> str:
    """The template of the route that answered (``other`` when none matched)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else OTHER


class ObserveMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: ServerMetrics | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.timer = timer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
        rid = request_id(sent)
        echo = (REQUEST_ID_HEADER, rid.encode("ascii"))
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [h for h in message.get("headers", ()) if h[0] != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, echo]}
            await send(message)

        token = REQUEST_ID.set(rid)
        start = self.timer()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
            if self.metrics is not None:
                # no answer started: an exception went up (the server answers 500)
                self.metrics.api_request(
                    scope["method"], route_label(scope), status or 500, self.timer() - start
                )
