"""Failover of a request whose backend connection failed: pure policy, no I/O.

A request is sent on to *another* backend of its route only when no byte of it can have
reached its first backend, because a POST is not idempotent, and a generation must never
run twice. The gateway's own client (``http_wire``) knows that exactly and says so on
every failure (``WireError.nothing_sent``):

* ``ConnectFailed``: connection refused or reset during the TCP handshake, no route to
  host, DNS failure, TLS handshake failure;
* ``ConnectTimeout``: the connect timeout ran out;
* ``Unwritten``: the pooled connection was found closed by the peer before the request
  was written (``Upstream.open`` first resends it once to the *same* backend on a fresh
  connection: the backend never got the request, so it cannot have started a
  generation).

Not proof, on purpose: ``Disconnected`` (the connection closed after the request was
written — a backend that read the request and then died cannot be told apart from one
that closed an idle keep-alive connection just as it was reused) and ``ReadTimeout``.
Those are answered 502/504, which OpenAI's SDKs retry.

The bound: at most ``max_retries`` further backends (default 1), never one already
tried, never an ejected one (the retry does not fail open: the first attempt's error is
a better answer than a guess), and the failed backend is ejected as any failure is (M5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from heteroflow.schemas.routing import RouteTarget

DEFAULT_CONNECT_RETRIES = 1


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
