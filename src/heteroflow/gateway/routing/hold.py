"""Holding a request until its model is routable: asleep (F6) or starting (M17).

A request whose model has a route but no routable backend is not refused at once when
a backend is on its way: the snapshot lists a sleeping service's model (its route target
says ``asleep``: "sleeping" or "waking"), and a target whose group has replicas
starting says so (``starting``: how many, and since when). ``Router`` hands such a
request to ``RoutableHold.hold``, the one door for both reasons (``hold_reason``):

1. One shared hold per (tenant, model) at a time; requests that arrive meanwhile join
   it, so a thousand held requests make one poll, not a thousand. For a sleeping model
   the first request asks the server to wake the sleeping groups
   (``ServerLink.wake``: in the server's own process a database call, from a separate
   gateway ``POST /api/v1/gateway/wake`` with the gateway token); groups already
   "waking" are not asked again. Starting replicas need nothing asked: nothing sleeps.
2. A wake's answer says, per task, which way it went. When none is on its way up (node
   offline, card borrowed by training, container gone, failed) every request of that
   wake is answered 503 with the server's message and ``Retry-After`` — never a silent
   hang.
3. Otherwise the request is held until a backend of its model is in the snapshot (the
   shared hold re-reads it every ``poll_s``, asking the server for a fresh one:
   ``ServerLink.refresh``), then it goes on like any other request — so a streaming
   client gets its first chunk when the engine is up. Each request waits at most
   ``hold_s`` (asleep) or ``start_hold_s`` (starting) from its arrival, then 503 +
   ``Retry-After`` with a message that says what it waited for (for starting replicas:
   how many, and how long they have been starting); a client that leaves stops waiting.
   A model that stops being asleep or starting without becoming routable (its wake or
   its replicas failed, it was stopped) ends the hold at once with 503.
4. With holding off (0) the request is answered 503 + ``Retry-After`` at once — for a
   sleeping model as soon as the server took the wake (or said why it cannot).

A route whose replicas all failed has none starting: it is refused at once, as before.
The two bounds differ on purpose: a wake is bounded by the service's own load (seconds
to a minute, F6's two minutes), while a new replica may pull an image and load a 70B
model for many minutes — a client held that long is worse off than one told "starting
for 95 s, retry in 10 s", so ``start_hold_s`` is short (30 s: the snapshot's catch-up
after "running", half a second, and a small model's whole cold start, a few seconds).

The wake itself goes on server-side whatever the requests do. Counts: held requests (a
gauge), holds by reason and outcome, wakes by branch, and the time held until ready
(``GatewayMetrics``; labels bounded by routed model names and fixed word lists).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
import orjson

from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.routing.poller import PollError, SnapshotPoller
from heteroflow.gateway.wire import errors
from heteroflow.schemas.routing import (
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    WakeOutcome,
)

logger = logging.getLogger(__name__)

WAKE_PATH = "/api/v1/gateway/wake"
DEFAULT_HOLD_S = 120.0
DEFAULT_START_HOLD_S = 30.0
DEFAULT_RETRY_AFTER_S = 10
DEFAULT_POLL_S = 0.2
DEFAULT_WAKE_TIMEOUT_S = 10.0


class ServerLink(Protocol):
    """How a gateway asks its server for a wake and for a fresh snapshot."""

    async def wake(self, group_ids: Sequence[str], model: str) -> Sequence[WakeOutcome]:
        """One outcome per task of the groups; raises when the server could not be asked."""
        ...

    async def refresh(self) -> None:
        """Bring the gateway's snapshot up to date now (best effort, never raises)."""
        ...

    async def aclose(self) -> None: ...


class WakeError(Exception):
    """A wake could not be asked for; the message is safe to log (no token)."""


class HttpServerLink:
    """A separate gateway's line to its server (the gateway token, like its polls)."""

    def __init__(
        self,
        server_url: str,
        token: str,
        holder: SnapshotHolder,
        *,
        timeout_s: float = DEFAULT_WAKE_TIMEOUT_S,
    ) -> None:
        self._url = server_url.rstrip("/") + WAKE_PATH
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # its own poller: a held request must not wait for the gateway's next poll
        self._poller = SnapshotPoller(server_url, token, holder)

    async def wake(self, group_ids: Sequence[str], model: str) -> list[WakeOutcome]:
        body = orjson.dumps({"group_ids": list(group_ids), "model": model})
        try:
            async with (
                aiohttp.ClientSession(timeout=self._timeout) as session,
                session.post(self._url, data=body, headers=self._headers) as resp,
            ):
                if resp.status >= 300:
                    raise WakeError(f"HTTP {resp.status} from {self._url}")
                data = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WakeError(f"{type(exc).__name__} posting to {self._url}") from exc
        except orjson.JSONDecodeError as exc:
            raise WakeError(f"malformed answer from {self._url}") from exc
        try:
            return [WakeOutcome.from_wire(r) for r in data["results"]]
        except (KeyError, TypeError) as exc:
            raise WakeError(f"malformed answer from {self._url}") from exc

    async def refresh(self) -> None:
        try:
            await self._poller.poll_once()
        except PollError as exc:
            logger.debug("hold: snapshot refresh failed: %s", exc)

    async def aclose(self) -> None:
        await self._poller.aclose()


# --- the outcome of one hold -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """A backend of the model is in ``snapshot``: route the request with it."""

    snapshot: RoutingSnapshot


@dataclass(frozen=True, slots=True)
class Refused:
    """Answer the request with ``error`` and ``Retry-After``; ``outcome`` is the metrics
    label (refused | timeout | not_held | failed)."""

    error: errors.OpenAIError
    retry_after_s: int
    outcome: str

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after_s).encode())]


class ClientLeft:
    """The client went away while its request was held."""


CLIENT_LEFT = ClientLeft()
HoldResult = Ready | Refused | ClientLeft


Reason = Literal["asleep", "starting"]


def routable(targets: Sequence[RouteTarget] | None) -> bool:
    """Some target has a backend that takes new requests."""
    return bool(targets) and any(
        not b.draining for t in targets or () for b in t.backends
    )


def asleep(targets: Sequence[RouteTarget] | None) -> bool:
    """Some target's group is sleeping or waking: a request may wake it and wait."""
    return bool(targets) and any(t.asleep for t in targets or ())


def starting(targets: Sequence[RouteTarget] | None) -> bool:
    """Some target's group has replicas on their way up: a request may wait for them."""
    return bool(targets) and any(t.starting for t in targets or ())


def hold_reason(targets: Sequence[RouteTarget] | None) -> Reason | None:
    """Why a request for these targets may be held (None: route it, or refuse it now).
    A sleeping group comes first: its wake has to be asked for."""
    if routable(targets):
        return None
    if asleep(targets):
        return "asleep"
    if starting(targets):
        return "starting"
    return None


def starting_for(targets: Sequence[RouteTarget] | None, now: float) -> tuple[int, float]:
    """(replicas starting, seconds the longest-waiting one has been starting; 0 unknown)."""
    ts = [t for t in targets or () if t.starting]
    since = [t.starting_since for t in ts if t.starting_since > 0]
    return sum(t.starting for t in ts), max(0.0, now - min(since)) if since else 0.0


class _Shared:
    """The one hold of a (tenant, model) that concurrent requests share."""

    __slots__ = ("asked", "done", "task", "waiters")

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        # the server answered the wake (or none was needed): None (something is on its
        # way up) or a Refused
        self.asked: asyncio.Future[Refused | None] = loop.create_future()
        self.done: asyncio.Future[Ready | Refused] = loop.create_future()  # the hold's end
        self.waiters = 0
        self.task: asyncio.Task[None] | None = None

    def answer(self, refused: Refused | None) -> None:
        if not self.asked.done():
            self.asked.set_result(refused)
        if refused is not None:
            self.finish(refused)

    def finish(self, result: Ready | Refused) -> None:
        if not self.asked.done():
            self.asked.set_result(result if isinstance(result, Refused) else None)
        if not self.done.done():
            self.done.set_result(result)


class RoutableHold:
    """The one door that holds a request until its model is routable (see the module)."""

    def __init__(
        self,
        holder: SnapshotHolder,
        link: ServerLink | None,
        metrics: GatewayMetrics,
        *,
        hold_s: float = DEFAULT_HOLD_S,
        start_hold_s: float = DEFAULT_START_HOLD_S,
        retry_after_s: int = DEFAULT_RETRY_AFTER_S,
        poll_s: float = DEFAULT_POLL_S,
        wake_timeout_s: float = DEFAULT_WAKE_TIMEOUT_S,
        monotonic: Callable[[], float] = time.monotonic,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._holder = holder
        self.link = link
        self._metrics = metrics
        self.hold_s = hold_s  # a sleeping model's bound (F6)
        self.start_hold_s = start_hold_s  # a starting model's bound (M17)
        self.retry_after_s = retry_after_s
        self._poll_s = poll_s
        self._wake_timeout_s = wake_timeout_s
        self._monotonic = monotonic
        self._now = now  # wall clock (epoch s): how long replicas have been starting
        self._holds: dict[tuple[str, str], _Shared] = {}
        # one refresh of the snapshot at a time, at most one per poll_s for all the
        # models held together (fifty services starting at once make one, not fifty)
        self._refreshing: asyncio.Future[None] | None = None
        self._refreshed_at = float("-inf")

    @property
    def holds_in_progress(self) -> int:
        return len(self._holds)

    async def hold(
        self,
        tenant: str,
        model: str,
        targets: Sequence[RouteTarget],
        left: Callable[[], Awaitable[object]] | None = None,
    ) -> HoldResult:
        """Wake the model's sleeping groups (shared) or wait for its starting replicas,
        until a backend is up; see the module. ``left()`` completes when the client
        disconnects (None: never)."""
        reason = hold_reason(targets)
        if reason is None:  # nothing to wait for: the caller's 503
            return Refused(errors.no_healthy_backend(model), self.retry_after_s, "failed")
        is_start = reason == "starting"
        started = self._monotonic()
        metrics = self._metrics
        refused: Refused | None = None
        if not is_start and self.link is None:
            # a gateway with no server behind it cannot wake anything
            refused = Refused(
                errors.model_unavailable(model, "this gateway cannot wake it"),
                self.retry_after_s,
                "refused",
            )
        elif is_start and self.start_hold_s <= 0:
            refused = self._starting(model, targets, None, "not_held")
        if refused is not None:
            metrics.hold_done(model, refused.outcome, None, starting=is_start)
            return refused
        key = (tenant, model)
        w = self._holds.get(key)
        if w is None:
            w = self._holds[key] = _Shared()
            w.task = asyncio.create_task(self._run(key, w, tenant, model, tuple(targets)))
        w.waiters += 1
        metrics.hold_started(model)
        gone: asyncio.Future[Any] | None = None if left is None else asyncio.ensure_future(left())
        try:
            result = await self._wait(w, tenant, model, gone, reason)
        finally:
            w.waiters -= 1
            metrics.hold_ended(model)
            if gone is not None:
                gone.cancel()
        if isinstance(result, Refused):
            outcome = result.outcome
        else:
            outcome = "client_left" if isinstance(result, ClientLeft) else "ready"
        metrics.hold_done(
            model,
            outcome,
            self._monotonic() - started if isinstance(result, Ready) else None,
            starting=is_start,
        )
        return result

    def _starting(
        self, model: str, targets: Sequence[RouteTarget] | None, held_s: float | None, outcome: str
    ) -> Refused:
        """503 + Retry-After saying how many replicas start, and for how long."""
        replicas, for_s = starting_for(targets, self._now())
        return Refused(
            errors.model_starting(
                model, self.retry_after_s, max(replicas, 1), for_s, held_s=held_s
            ),
            self.retry_after_s,
            outcome,
        )

    async def _wait(
        self,
        w: _Shared,
        tenant: str,
        model: str,
        gone: asyncio.Future[Any] | None,
        reason: Reason,
    ) -> HoldResult:
        aws: set[asyncio.Future[Any]] = set()
        if gone is not None:
            aws.add(gone)
        bound = self.start_hold_s if reason == "starting" else self.hold_s
        if bound <= 0:
            # a sleeping model, no holding: wait only for the server to take the wake
            # (or say why not)
            asked: asyncio.Future[Any] = asyncio.shield(w.asked)
            done, _ = await asyncio.wait(
                {asked, *aws}, timeout=self._wake_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if asked in done:
                refused = w.asked.result()
                if refused is not None:
                    return refused
            else:
                asked.cancel()
                if gone is not None and gone in done:
                    return CLIENT_LEFT
            return Refused(
                errors.model_waking(model, self.retry_after_s), self.retry_after_s, "not_held"
            )
        end: asyncio.Future[Any] = asyncio.shield(w.done)
        done, _ = await asyncio.wait(
            {end, *aws}, timeout=bound, return_when=asyncio.FIRST_COMPLETED
        )
        if end in done:
            return w.done.result()
        end.cancel()
        if gone is not None and gone in done:
            return CLIENT_LEFT
        if reason == "starting":
            return self._starting(
                model, self._holder.current.routes.get((tenant, model)), bound, "timeout"
            )
        return Refused(
            errors.model_waking(model, self.retry_after_s, held_s=bound),
            self.retry_after_s,
            "timeout",
        )

    async def _run(
        self,
        key: tuple[str, str],
        w: _Shared,
        tenant: str,
        model: str,
        targets: tuple[RouteTarget, ...],
    ) -> None:
        try:
            if hold_reason(targets) == "asleep":
                await self._ask(w, model, targets)
                if self.hold_s <= 0:  # not held: the wake was all there was to do
                    return
            else:
                w.answer(None)  # starting: nothing to ask, just wait
            if w.done.done():
                return
            await self._follow(w, tenant, model)
        except Exception:  # never leave a request hanging on a bug here
            logger.exception("hold for model %s: unexpected failure", model)
            w.finish(
                Refused(
                    errors.wake_failed(model, "an internal error")
                    if asleep(targets)
                    else errors.no_healthy_backend(model),
                    self.retry_after_s,
                    "failed",
                )
            )
        finally:
            if self._holds.get(key) is w:
                del self._holds[key]
            if not w.done.done():  # every waiter left (timed out or gone)
                w.finish(
                    Refused(
                        errors.no_healthy_backend(model), self.retry_after_s, "timeout"
                    )
                )

    async def _ask(self, w: _Shared, model: str, targets: tuple[RouteTarget, ...]) -> None:
        """Ask the server to wake the sleeping groups (those already waking need not)."""
        assert self.link is not None
        groups = list(dict.fromkeys(t.group_id for t in targets if t.asleep == "sleeping"))
        if not groups:
            w.answer(None)  # all waking already: just wait
            return
        try:
            outcomes = await asyncio.wait_for(
                self.link.wake(groups, model), self._wake_timeout_s
            )
        except Exception as exc:
            self._metrics.woken(model, "error")
            logger.warning("wake of model %s: the server could not be asked: %s", model, exc)
            w.answer(
                Refused(
                    errors.wake_failed(model, "the server could not be reached"),
                    self.retry_after_s,
                    "failed",
                )
            )
            return
        for o in outcomes:
            self._metrics.woken(model, o.branch)
        if any(o.holding for o in outcomes):
            w.answer(None)
            return
        message = "; ".join(dict.fromkeys(o.message for o in outcomes if o.message))
        w.answer(
            Refused(
                errors.model_unavailable(model, message or "it has nothing to wake"),
                self.retry_after_s,
                "refused",
            )
        )

    async def _follow(self, w: _Shared, tenant: str, model: str) -> None:
        """Re-read the snapshot until the model has a backend, while anyone waits."""
        while w.waiters > 0:
            snap = self._holder.current
            targets = snap.routes.get((tenant, model))
            if routable(targets):
                w.finish(Ready(snap))
                return
            if not asleep(targets) and not starting(targets):
                # neither asleep nor on its way up, and not serving: the wake or the
                # replicas failed, or it was stopped
                w.finish(
                    Refused(
                        errors.no_healthy_backend(model), self.retry_after_s, "failed"
                    )
                )
                return
            await asyncio.sleep(self._poll_s)
            await self._refresh()

    async def _refresh(self) -> None:
        """Ask the server for a fresh snapshot, shared by every hold (see ``__init__``);
        without a server the gateway's own poller follows it."""
        if self.link is None:
            return
        if self._refreshing is None or self._refreshing.done():
            if self._monotonic() - self._refreshed_at < self._poll_s:
                return  # another model's hold just asked
            self._refreshed_at = self._monotonic()
            self._refreshing = asyncio.ensure_future(self.link.refresh())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._refreshing)

    async def aclose(self) -> None:
        for w in list(self._holds.values()):
            if w.task is not None:
                w.task.cancel()
        self._holds.clear()
        if self._refreshing is not None:
            self._refreshing.cancel()
        if self.link is not None:
            await self.link.aclose()
