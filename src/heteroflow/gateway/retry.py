"""Failover of a request whose backend connection failed: pure policy, no I/O.

A request is sent on to *another* backend of its route only when its first backend could
not be connected to, because then no byte of the request can have reached it: a POST is
not idempotent, and a generation must never run twice. Exactly these exceptions, raised
by ``aiohttp.ClientSession.post``, give that guarantee (aiohttp 3.14, ``client.py``'s
``_connect_and_send_request``: they come only out of ``connector.connect()``, which
returns before ``ClientRequest.send`` writes anything):

* ``aiohttp.ClientConnectorError`` and its subclasses: connection refused or reset
  during the TCP handshake, no route to host, DNS failure
  (``ClientConnectorDNSError``), TLS handshake failure (``ClientConnectorSSLError``,
  ``ClientConnectorCertificateError``), a proxy that could not be reached;
* ``aiohttp.ConnectionTimeoutError``: ``sock_connect`` (the connect timeout) ran out,
  or the whole ``connector.connect()`` did (DNS, handshake).

Not in the list, on purpose: ``ServerDisconnectedError``, ``ClientOSError`` (a reset),
``ClientConnectionResetError`` and ``SocketTimeoutError`` (the read timeout). They come
after the request was written to the socket, and a backend that read the request and
then died cannot be told apart from one that closed an idle keep-alive connection just
as it was reused. aiohttp does not surface a pooled connection "found dead before the
write" distinctly: a connection whose close the event loop has already seen is dropped
silently in ``BaseConnector._get`` (``proto.is_connected()``) and a new one is opened,
whose failure is again a ``ClientConnectorError``; the remaining race shows up only
after the write.

One narrower case is provable, and ``Upstream.open`` resends it once to the *same*
backend on a fresh (never pooled) connection: aiohttp could not hand the request to the
socket because the pooled connection's transport was already closing — the peer had
closed it before our request was written (``request_unwritten``). Then the backend
never got a complete request (its body at most in part, with a Content-Length it waits
for), so it cannot have started a generation. A ``ServerDisconnectedError`` or a reset
*after* the write stays unprovable and is answered 502 (OpenAI's SDKs retry it).

The bound: at most ``max_retries`` further backends (default 1), never one already
tried, never an ejected one (the retry does not fail open: the first attempt's error is
a better answer than a guess), and the failed backend is ejected as any failure is (M5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import aiohttp

from heteroflow.schemas.routing import RouteTarget

DEFAULT_CONNECT_RETRIES = 1

NOTHING_SENT: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
)
_BODY_UNWRITTEN = "Can not write request body"


def nothing_sent(exc: BaseException) -> bool:
    """True when ``exc``, raised by ``session.post()``, proves no request byte left."""
    return isinstance(exc, NOTHING_SENT)


def request_unwritten(exc: BaseException) -> bool:
    """True when ``exc``, raised by ``session.post()``, says the request was never
    completely written: the writer found the transport closing (``ClientConnectionResetError``
    from ``StreamWriter``), or writing the body failed (aiohttp 3.14 wraps that as a
    ``ClientOSError`` "Can not write request body", ``ClientRequest.write_bytes``)."""
    if isinstance(exc, aiohttp.ClientConnectionResetError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and str(exc.strerror or "").startswith(
        _BODY_UNWRITTEN
    )


def may_fail_over(*, nothing_sent: bool, retries_done: int, max_retries: int) -> bool:
    """Whether a failed attempt may be followed by one to another backend."""
    return nothing_sent and retries_done < max_retries


def without(targets: Sequence[RouteTarget], tried: Collection[str]) -> tuple[RouteTarget, ...]:
    """``targets`` less every backend whose ``base_url`` is in ``tried``.

    A target left with no backend stays (empty), as a route target with no running
    backend does: selection then fails over past it by priority and weight as usual.
    """
    out: list[RouteTarget] = []
    for t in targets:
        kept = tuple(b for b in t.backends if b.base_url not in tried)
        out.append(t if len(kept) == len(t.backends) else dataclasses.replace(t, backends=kept))
    return tuple(out)
