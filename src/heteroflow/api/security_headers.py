"""The browser-facing security headers of every answer of the management API: one
place, so no page the server serves (the console, the API reference at /api/v1/docs, an
error page) can be left without them (docs/security.md "Pages served to a browser").

A pure ASGI wrapper sets them on every answer, replacing any a route set: a strict
Content-Security-Policy (scripts, styles, images and connections of this origin only, no
inline script or style, no ``eval``), no framing by any site (``frame-ancestors 'none'``
and, for browsers older than CSP 2, ``X-Frame-Options: DENY``), no content sniffing and
no referrer. On JSON answers they cost a few bytes and forbid nothing a client does; on
HTML and SVG they are what keeps an injected string from running. The gateway's /v1 does
not pass through here (api/app.py's Dispatcher): it serves no page.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_RAW = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in SECURITY_HEADERS.items()]
_NAMES = frozenset(name for name, _ in _RAW)


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers", ()) if h[0].lower() not in _NAMES]
                message = {**message, "headers": [*kept, *_RAW]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
