"""Failover of a request whose backend failed before answering: pure policy, no I/O.

A POST is not idempotent and a generation should not run twice, so a request is sent
on to *another* backend of its route only when its first backend provably did not
answer it. The gateway's own client (``http_wire``) knows that exactly and says so on
every failure:

* nothing of the request left (``WireError.nothing_sent``) — ``ConnectFailed`` (refused,
  reset during the handshake, no route to host, DNS, TLS handshake), ``ConnectTimeout``,
  and ``Unwritten`` (a pooled connection found closed by the peer before the write;
  ``Upstream.open`` first resends it once to the *same* backend on a fresh connection:
  that backend never got the request). Up to ``connect_retries`` further backends
  (default 1; 0 turns it off);
* the request left but no byte of an answer came back before the connection closed or
  was reset (``WireError.unanswered``: a ``Disconnected`` with nothing heard) — the
  engine died holding it, or closed an idle keep-alive connection as it was reused. The
  client has had nothing either, so another backend is tried **once** per request
  (``retry_unanswered``, default on). The price: an engine that did start the
  generation and lives on (its connection cut by something else) runs it twice; an
  engine that died runs nothing.

Never sent again: a silence (``ReadTimeout``: the engine may still be generating), any
answer begun (a partial one, or an HTTP error status: that *is* the answer), anything
after a byte reached the client (the relay starts only once a response's headers are
read, so the client has had nothing until then). Those are answered 502/504 or end the
stream with an error event, as OpenAI's SDKs expect.

The bound: never a backend already tried, never an ejected one (the failover does not
fail open: the first attempt's error is a better answer than a guess), the failed
backend ejected as any failure is (M5), and no attempt after the request's deadline —
``upstream_timeout_s`` from its first send, the longest a client waits for an answer
with no failover — which also bounds the wait for the next backend's answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from heteroflow.schemas.routing import RouteTarget

DEFAULT_CONNECT_RETRIES = 1


class Failovers:
    """One request's failovers: the backends it was sent to, what each budget has left,
    and its deadline (``time.monotonic()``). Made at the request's first failure, so a
    request that never fails allocates nothing."""

    __slots__ = ("_connect_left", "_unanswered_left", "deadline", "tried")

    def __init__(self, connect_retries: int, retry_unanswered: bool, deadline: float) -> None:
        self.tried: list[str] = []
        self.deadline = deadline
        self._connect_left = connect_retries
        self._unanswered_left = retry_unanswered

    def allow(self, failed: str, *, nothing_sent: bool, unanswered: bool, now: float) -> bool:
        """Note that ``failed`` failed; whether the request may go on to another backend."""
        self.tried.append(failed)
        if now >= self.deadline:
            return False
        if nothing_sent:
            if self._connect_left > 0:
                self._connect_left -= 1
                return True
            return False
        if unanswered and self._unanswered_left:
            self._unanswered_left = False
            return True
        return False


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
