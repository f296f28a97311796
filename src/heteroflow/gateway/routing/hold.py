"""Wake on request (F6): a request for a sleeping model wakes it and waits for it.

The snapshot lists a sleeping service's model (its route target says ``asleep``:
"sleeping" or "waking") without a backend for the tasks that sleep. When a request's
model has no routable backend but such a target, ``GatewayApp`` hands it to
``WakeHold.hold``:

1. One wake per (tenant, model) at a time: the first request asks the server to wake the
   sleeping groups (``ServerLink.wake``: in the server's own process a database call,
   from a separate gateway ``POST /api/v1/gateway/wake`` with the gateway token);
   requests that arrive meanwhile join it. Groups already "waking" are not asked again.
2. Each task's answer says which way the wake went. When none is on its way up (node
   offline, card borrowed by training, container gone, failed) every request of that
   wake is answered 503 with the server's message and ``Retry-After`` — never a silent
   hang.
3. Otherwise the request is held until a backend of its model is in the snapshot (the
   shared wake re-reads it every ``poll_s``, asking the server for a fresh one:
   ``ServerLink.refresh``), then it goes on like any other request — so a streaming
   client gets its first chunk when the engine is up. Each request waits at most
   ``hold_s`` from its arrival (then 503 + ``Retry-After``); a client that leaves stops
   waiting. A service that stops being asleep without becoming routable (its wake
   failed) ends the hold at once with 503.
4. With holding off (``hold_s`` = 0) the request is answered 503 + ``Retry-After`` as
   soon as the server took the wake (or said why it cannot).

The wake itself goes on server-side whatever the requests do. Counts: held requests (a
gauge), holds by outcome, wakes by branch, and the time held until ready
(``GatewayMetrics``; labels bounded by routed model names and fixed word lists).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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
            logger.debug("wake: snapshot refresh failed: %s", exc)

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


def routable(targets: Sequence[RouteTarget] | None) -> bool:
    """Some target has a backend that takes new requests."""
    return bool(targets) and any(
        not b.draining for t in targets or () for b in t.backends
    )


def asleep(targets: Sequence[RouteTarget] | None) -> bool:
    """Some target's group is sleeping or waking: a request may wake it and wait."""
    return bool(targets) and any(t.asleep for t in targets or ())


class _Wake:
    """The one wake of a (tenant, model) that concurrent requests share."""

    __slots__ = ("asked", "done", "task", "waiters")

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        # the server answered the wake: None (something is on its way up) or a Refused
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


class WakeHold:
    def __init__(
        self,
        holder: SnapshotHolder,
        link: ServerLink | None,
        metrics: GatewayMetrics,
        *,
        hold_s: float = DEFAULT_HOLD_S,
        retry_after_s: int = DEFAULT_RETRY_AFTER_S,
        poll_s: float = DEFAULT_POLL_S,
        wake_timeout_s: float = DEFAULT_WAKE_TIMEOUT_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._holder = holder
        self.link = link
        self._metrics = metrics
        self.hold_s = hold_s
        self.retry_after_s = retry_after_s
        self._poll_s = poll_s
        self._wake_timeout_s = wake_timeout_s
        self._monotonic = monotonic
        self._wakes: dict[tuple[str, str], _Wake] = {}

    @property
    def wakes_in_progress(self) -> int:
        return len(self._wakes)

    async def hold(
        self,
        tenant: str,
        model: str,
        targets: Sequence[RouteTarget],
        left: Callable[[], Awaitable[object]] | None = None,
    ) -> HoldResult:
        """Wake the model's sleeping groups (shared) and wait for a backend; see the module.

        ``left()`` completes when the client disconnects (None: never)."""
        started = self._monotonic()
        metrics = self._metrics
        if self.link is None:  # a gateway with no server behind it cannot wake anything
            refused = Refused(
                errors.model_unavailable(model, "this gateway cannot wake it"),
                self.retry_after_s,
                "refused",
            )
            metrics.hold_done(model, refused.outcome, None)
            return refused
        key = (tenant, model)
        w = self._wakes.get(key)
        if w is None:
            w = self._wakes[key] = _Wake()
            w.task = asyncio.create_task(self._run(key, w, tenant, model, tuple(targets)))
        w.waiters += 1
        metrics.hold_started(model)
        gone: asyncio.Future[Any] | None = None if left is None else asyncio.ensure_future(left())
        try:
            result = await self._wait(w, model, gone)
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
            model, outcome, self._monotonic() - started if isinstance(result, Ready) else None
        )
        return result

    async def _wait(self, w: _Wake, model: str, gone: asyncio.Future[Any] | None) -> HoldResult:
        aws: set[asyncio.Future[Any]] = set()
        if gone is not None:
            aws.add(gone)
        if self.hold_s <= 0:
            # no holding: wait only for the server to take the wake (or say why not)
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
            {end, *aws}, timeout=self.hold_s, return_when=asyncio.FIRST_COMPLETED
        )
        if end in done:
            return w.done.result()
        end.cancel()
        if gone is not None and gone in done:
            return CLIENT_LEFT
        return Refused(
            errors.model_waking(model, self.retry_after_s, held_s=self.hold_s),
            self.retry_after_s,
            "timeout",
        )

    async def _run(
        self,
        key: tuple[str, str],
        w: _Wake,
        tenant: str,
        model: str,
        targets: tuple[RouteTarget, ...],
    ) -> None:
        try:
            await self._ask(w, model, targets)
            if w.done.done() or self.hold_s <= 0:
                return
            await self._follow(w, tenant, model)
        except Exception:  # never leave a request hanging on a bug here
            logger.exception("wake of model %s: unexpected failure", model)
            w.finish(
                Refused(
                    errors.wake_failed(model, "an internal error"), self.retry_after_s, "failed"
                )
            )
        finally:
            if self._wakes.get(key) is w:
                del self._wakes[key]
            if not w.done.done():  # every waiter left (timed out or gone)
                w.finish(
                    Refused(
                        errors.model_waking(model, self.retry_after_s),
                        self.retry_after_s,
                        "timeout",
                    )
                )

    async def _ask(self, w: _Wake, model: str, targets: tuple[RouteTarget, ...]) -> None:
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

    async def _follow(self, w: _Wake, tenant: str, model: str) -> None:
        """Re-read the snapshot until the model has a backend, while anyone waits."""
        assert self.link is not None
        while w.waiters > 0:
            snap = self._holder.current
            targets = snap.routes.get((tenant, model))
            if routable(targets):
                w.finish(Ready(snap))
                return
            if not asleep(targets):
                # no longer asleep, and not serving: the wake failed or it was stopped
                w.finish(
                    Refused(
                        errors.no_healthy_backend(model), self.retry_after_s, "failed"
                    )
                )
                return
            await asyncio.sleep(self._poll_s)
            with contextlib.suppress(Exception):
                await self.link.refresh()

    async def aclose(self) -> None:
        for w in list(self._wakes.values()):
            if w.task is not None:
                w.task.cancel()
        self._wakes.clear()
        if self.link is not None:
            await self.link.aclose()
