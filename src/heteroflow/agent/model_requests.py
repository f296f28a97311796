"""An operator's pull or eviction on this node's model cache (issue 29, H9: the
``heteroflow models pull`` and ``evict`` verbs), claimed through the agent's poll.

Each round asks the server for this node's pending requests (``GET
/api/v1/agent/model-requests``, beside the file requests and the pre-pulls), naming the
ones still under way here (``held``: a running one it does not name was lost and the
server fails it), and starts each new one as a job of its own, so that a download of
minutes holds up neither the next round nor the other requests.

- A pull gets its source as a launch does: ``fetch_plan.ways`` with the holders the
  server named (``AgentModelRequest.peers``), the node's resolver and hub token
  (``fetching.resolver_for``, ``fetching.token_for``) — a copy from a node that holds
  it first, the origin last; ``fleet://<key>`` from its holders only — and
  ``ModelCache.ensure``, so a task's launch fetch of the same model shares the one
  download. Progress goes to the server at most every ``image_pull_report_interval_s``
  (and at that pace while nothing moves, so a long unpack still says the job is alive),
  then ``done`` with the size and the cache key, or ``failed`` with the source's reason.
- An eviction is ``ModelCache.evict``: a model a task here uses (pinned) or one being
  downloaded is refused, and the request fails with that reason.
- The hub token never reaches a message: the source's errors carry none, and every text
  sent is scrubbed of it besides.
- An outcome the server did not take (it was away) is sent again at the next round; one
  it refuses (404, 409: it failed the request meanwhile) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import re

from heteroflow.agent.client import ServerError
from heteroflow.agent.fetch_plan import Way, fetch_first, ways
from heteroflow.agent.fetching import resolver_for, token_for
from heteroflow.agent.model_cache.download import Progress, ProgressCallback
from heteroflow.agent.state import AgentState
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.core.images import size_text
from heteroflow.core.model_requests import ModelRequestStatus, progress_text
from heteroflow.core.model_sources import parse_model_source
from heteroflow.models.fetch.manifest import SourceFailed
from heteroflow.schemas.model_requests import KEY_PATTERN, AgentModelRequest, ModelRequestReport

log = logging.getLogger(__name__)

S = ModelRequestStatus
_KEY = re.compile(KEY_PATTERN)


def _failed(message: str, key: str = "") -> ModelRequestReport:
    return ModelRequestReport(status=S.FAILED, message=message, key=key)


def _scrubbed(rep: ModelRequestReport, token: str | None) -> ModelRequestReport:
    if token and token in rep.message:
        return rep.model_copy(update={"message": rep.message.replace(token, "***")})
    return rep


class ModelRequests:
    """The requests under way on this node, and the outcomes not delivered yet."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task[None]] = {}
        self._unsent: dict[str, ModelRequestReport] = {}

    async def round(self, agent: AgentState) -> None:
        """Deliver what is owed, then claim and start this node's new requests."""
        for rid in [r for r, job in self._running.items() if job.done()]:
            del self._running[rid]
        for rid, rep in list(self._unsent.items()):
            if await self._deliver(agent, rid, rep):
                del self._unsent[rid]
        asks = await agent.client.model_requests(sorted({*self._running, *self._unsent}))
        for a in asks:
            if a.id not in self._running and a.id not in self._unsent:
                self._running[a.id] = asyncio.create_task(self._serve(agent, a))

    def cancel(self) -> None:
        for job in self._running.values():
            job.cancel()

    async def wait(self) -> None:
        """Until the requests under way have answered (tests; shutdown cancels them)."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def _serve(self, agent: AgentState, a: AgentModelRequest) -> None:
        token: str | None = None
        try:
            if a.action == "pull":
                token = _token(agent, a.source)
                rep = await self._pull(agent, a, token)
            else:
                rep = await _evict(agent, a.key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or the disk: the request still ends, with why
            log.exception("model request %s failed", a.id)
            rep = _failed(f"the agent failed: {type(exc).__name__}: {exc}")
        rep = _scrubbed(rep, token)
        log.info("model request %s (%s): %s: %s", a.id, a.action, rep.status, rep.message)
        if rep.status is S.DONE:
            agent._nudge.set()  # the next heartbeat now: the fleet's list shows it sooner
        if not await self._deliver(agent, a.id, rep):
            self._unsent[a.id] = rep

    async def _deliver(self, agent: AgentState, rid: str, rep: ModelRequestReport) -> bool:
        """True when the server took the outcome or will never take it (it moved on)."""
        try:
            await agent.client.model_report(rid, rep)
        except ServerError as exc:
            if exc.status in (404, 409):
                log.info("model request %s: the server moved on (%s)", rid, exc)
                return True
            log.warning("model request %s: outcome not delivered: %s", rid, exc)
            return False
        except Exception as exc:  # the server away: sent again next round
            log.warning("model request %s: outcome not delivered: %s", rid, exc)
            return False
        return True

    async def _pull(
        self, agent: AgentState, a: AgentModelRequest, token: str | None
    ) -> ModelRequestReport:
        try:
            source = parse_model_source(a.source, "source")
            tries = await ways(agent, source, token, list(a.peers), resolver_for(agent))
        except SourceFailed as exc:
            return _failed(f"{a.source} not pulled ({exc.reason}): {exc.message}")
        except ValidationFailed as exc:
            return _failed(f"{a.source} not pulled: {exc.message}")
        pull = _Pull(tries[0])
        ticker = asyncio.create_task(
            _progress(agent, a.id, pull, agent.settings.image_pull_report_interval_s, token)
        )
        try:
            way = await _fetch(agent, a.source, tries, pull)
        except SourceFailed as exc:
            return _failed(f"{a.source} not pulled ({exc.reason}): {exc.message}",
                           pull.way.manifest.cache_key)
        finally:
            ticker.cancel()
        key = way.manifest.cache_key
        held = await asyncio.to_thread(_bytes_of, agent, key)
        size = held if held is not None else way.manifest.total_bytes
        how = f", {way.said}" if way.said else ""
        return ModelRequestReport(
            status=S.DONE, key=key, done_bytes=size, total_bytes=size,
            message=f"{a.source} is in this node's cache as {key}: {size_text(size)}, "
            f"{len(way.manifest.files)} file(s), revision {way.manifest.revision or '-'}{how}",
        )


class _Pull:
    """The way being tried and its latest progress (what the ticker reports)."""

    def __init__(self, way: Way) -> None:
        self.way = way
        self.latest: Progress | None = None

    def report(self) -> ModelRequestReport:
        m, p = self.way.manifest, self.latest
        doing = f"copying {m.source.text} from node {m.copied_from}" if m.copied_from \
            else f"pulling {m.source.text}"
        done = p.done_bytes if p is not None else 0
        text = (
            progress_text(doing, done, p.total_bytes or m.total_bytes, p.rate_bps, p.eta_s)
            if p is not None
            else f"{doing}: {size_text(m.total_bytes)} in {len(m.files)} file(s), revision "
            f"{m.revision or '-'}"
        )
        return ModelRequestReport(status=S.RUNNING, message=text, done_bytes=done,
                                  total_bytes=m.total_bytes, key=m.cache_key)


async def _fetch(agent: AgentState, shown: str, tries: list[Way], pull: _Pull) -> Way:
    """``fetch_first`` (a holder's copy first, the origin last), its progress kept on
    ``pull`` for the reports."""

    def watching(way: Way) -> ProgressCallback:
        pull.way, pull.latest = way, None
        return lambda p: setattr(pull, "latest", p)

    return await fetch_first(agent.model_cache, tries, watching, f"pull of {shown}")


def _token(agent: AgentState, text: str) -> str | None:
    try:
        return token_for(agent, parse_model_source(text, "source"))
    except ValidationFailed:
        return None  # refused by _pull with the reason; no token goes anywhere


async def _progress(
    agent: AgentState, rid: str, pull: _Pull, every_s: float, token: str | None
) -> None:
    """Report the pull's progress now, then every ``every_s`` until cancelled (or until the
    server says the request is over: it failed it meanwhile)."""
    while True:
        try:
            await agent.client.model_report(rid, _scrubbed(pull.report(), token))
        except ServerError as exc:
            if exc.status in (404, 409):
                return
            log.debug("model request %s: progress not delivered: %s", rid, exc)
        except Exception as exc:  # the server away: the next report may land
            log.debug("model request %s: progress not delivered: %s", rid, exc)
        await asyncio.sleep(every_s)


def _bytes_of(agent: AgentState, key: str) -> int | None:
    for m in agent.model_cache.list():
        if m.key == key and m.state == "complete":
            return m.bytes
    return None


async def _evict(agent: AgentState, key: str) -> ModelRequestReport:
    if not _KEY.match(key):  # the server checks it too; the disk is this agent's to guard
        return _failed(f"{key!r} is not a cache key")
    size = await asyncio.to_thread(_bytes_of, agent, key)
    try:
        await asyncio.to_thread(agent.model_cache.evict, key)
    except Conflict as exc:
        return _failed(
            f"refused: {exc.message} (a task here uses it: stop that service first, or wait "
            "for its download to end)", key,
        )
    except NotFound as exc:
        return _failed(exc.message, key)
    return ModelRequestReport(
        status=S.DONE, key=key, done_bytes=size or 0, total_bytes=size or 0,
        message=f"{key} evicted from this node's cache"
        + (f": {size_text(size)} freed" if size else ""),
    )
