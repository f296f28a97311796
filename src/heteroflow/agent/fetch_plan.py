"""Where a node gets a model source from (issue 29 items 2 and 4): the ways to try, in
order, each a manifest and how to ask for its files.

- ``fleet://<key>``: this node's own copy; else the holders the claim named
  (``TaskAssignment.model_peers``), the first that describes its copy, then the others.
- a hub or a URL: the origin is asked what the source names now (its revision, files,
  checksums). This node's copy of that revision is used as it is; else a holder's copy
  of that revision, checked against the origin's sizes and checksums, then the origin
  itself (a copy cut halfway resumes from the origin: one folder per key).
- the origin cannot be asked (unreachable, timeout: a hub down, an air-gapped fleet):
  this node's copy of the source as named (any revision it resolved to), else a
  holder's, which the task's status says ("the origin could not be asked"). An origin
  that answers no (not found, unauthorized) is never bypassed by a copy.

``fetch_first`` then tries them in order: a launch (``agent.fetching``) and an
operator's pull (``agent.model_requests``) alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.model_sources import FIELD, ModelSource, SourceKind, parse_model_source
from heteroflow.models.fetch.http import Signer
from heteroflow.models.fetch.manifest import Manifest, SourceFailed
from heteroflow.models.fetch.peer import node_signer, peer_manifest, via_peer
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.schemas.nodes import PeerCopy

if TYPE_CHECKING:
    from heteroflow.agent.model_cache import ModelCache
    from heteroflow.agent.model_cache.download import ProgressCallback
    from heteroflow.agent.state import AgentState

log = logging.getLogger(__name__)

#: An origin that fails so may be bypassed by a copy (it could not be asked at all).
UNASKABLE = ("unreachable", "timeout")


@dataclass(frozen=True, slots=True)
class Way:
    """One way to get the model: its manifest, and the token (the origin) or the
    signer (a holder) its files are asked with; ``said``: how the status says it."""

    manifest: Manifest
    token: str | None = None
    signer: Signer | None = None
    said: str = ""


async def ways(
    agent: AgentState, source: ModelSource, token: str | None, peers: list[PeerCopy],
    resolver: SourceResolver,
) -> list[Way]:
    """The ways to try, best first (never empty), or ``SourceFailed``."""
    cache = agent.model_cache
    if source.kind is SourceKind.FLEET:
        held = cache.manifest_of(source.location)
        if held is not None:
            return [Way(held)]
        return await _copies(agent, [p for p in peers if p.key == source.location],
                             f"{source.text}: no node holding it")
    try:
        manifest = await resolver.resolve(source, token)
    except SourceFailed as exc:
        if exc.reason not in UNASKABLE:
            raise
        held = held_copy(cache, source)
        why = f"the origin could not be asked ({exc.reason})"
        if held is not None:
            log.warning("model %s: %s; using this node's copy", source.text, why)
            return [Way(held, said=f"{why}; this node's copy")]
        if not peers:
            raise
        found = await _copies(agent, peers, exc.message)
        return [Way(w.manifest, signer=w.signer, said=f"{why}; {w.said}") for w in found]
    if cache.is_complete(manifest.cache_key):
        return [Way(manifest, token)]
    signer = _signer(agent)
    copies = [Way(via_peer(manifest, p), signer=signer, said=f"copied from node {p.node}")
              for p in peers if p.key == manifest.cache_key]
    return [*copies, Way(manifest, token)]


async def fetch_first(
    cache: ModelCache, tries: list[Way], progress: Callable[[Way], ProgressCallback],
    what: str,
) -> Way:
    """The first way that completes the model: a holder that fails (gone, cut, its bytes
    not the source's) gives way to the next, the origin last. What the node itself cannot
    do (its budget, its disk) ends it at once. ``progress(way)``: that way's listener."""
    for i, way in enumerate(tries):
        try:
            await cache.ensure(way.manifest, token=way.token, signer=way.signer,
                               progress=progress(way))
            return way
        except SourceFailed as exc:
            if i == len(tries) - 1 or exc.reason in ("budget", "disk"):
                raise
            log.warning("%s: %s; trying %s", what, exc.message,
                        tries[i + 1].said or "the origin")
    raise AssertionError("no way to fetch was given")  # ways() never returns none


def held_copy(cache: ModelCache, source: ModelSource) -> Manifest | None:
    """This node's complete copy of ``source`` as named (at any revision it resolved to:
    ``@main`` then), the most recently used first."""
    for m in reversed(cache.list()):
        if m.state != "complete":
            continue
        try:
            cached = parse_model_source(m.source)
        except ValidationFailed:
            continue
        if source.text in (cached.text, cached.pinned(m.revision).text):
            return cache.manifest_of(m.key)
    return None


async def _copies(agent: AgentState, peers: list[PeerCopy], none_said: str) -> list[Way]:
    """Copies from ``peers``: the manifest of the first that answers, fetched from it and
    then from the others that hold the same key."""
    signer = _signer(agent)
    failures: list[str] = []
    timeout = aiohttp.ClientTimeout(total=agent.settings.model_resolve_timeout_s)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=agent.model_cache.tls)
    ) as session:
        for i, p in enumerate(peers):
            try:
                manifest = await peer_manifest(session, p, signer, timeout)
            except SourceFailed as e:
                failures.append(f"node {p.node}: {e.message.removeprefix(f'{FIELD}: ')}")
                continue
            rest = [q for q in peers[i + 1:] if q.key == p.key]
            return [Way(manifest, signer=signer, said=f"copied from node {p.node}"),
                    *(Way(via_peer(manifest, q), signer=signer,
                          said=f"copied from node {q.node}") for q in rest)]
    if not peers:
        raise SourceFailed("not_found", f"{FIELD}: {none_said} serves copies now")
    raise SourceFailed("unreachable", f"{FIELD}: no node holding the model answered "
                       f"({'; '.join(failures)})")


def _signer(agent: AgentState) -> Signer:
    return node_signer(agent.name, agent.settings.node_token,
                       lambda: agent.clock.now().timestamp())
