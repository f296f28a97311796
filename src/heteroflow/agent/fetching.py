"""Models that come to the node (issue 29, FEATURES H9): a source fetched before a launch.

A task whose ``model_path`` is written as a source (``hf://``, ``modelscope://``,
``https://``; ``core.model_sources``) is resolved on the node (``models.fetch``: the
files, their sizes and checksums, the revision) and fetched into the node's cache
(``agent.model_cache``: one copy per resolved revision, shared by every task that asks,
resumed and checked) before the engine starts; the launch then gets the cache entry's
path (``TaskAssignment.model_fetched``: that path alone passes the node's allow-list).

The task's status says how it goes, as an image pull's does: a ``fetch`` note when the
fetch begins and ends (an event, ``task.model_fetch``), ``fetching`` notes at most every
``image_pull_report_interval_s`` ("fetching model …: 1.2 of 4.5 GB at 80 MB/s, ~45 s
left", the status message alone). A source that cannot be resolved or fetched fails the
launch with the source's reason (not found, unauthorised, unreachable, timeout, checksum,
budget, disk). The entry stays pinned (never evicted) while the task runs or sleeps here,
and is released when its task stops. The hub token is the one the claim carried
(``TaskAssignment.hub_token``: the task's tenant's, H9), else the node's (``hub_token``),
sent only to the hub it was given for; it never reaches a log, a note or an event.
"""

from __future__ import annotations

import logging
from pathlib import Path

from heteroflow.agent.fetch_plan import Way, fetch_first, ways
from heteroflow.agent.model_cache.download import Progress, ProgressCallback
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.agent.state import AgentState
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.images import size_text
from heteroflow.core.model_sources import (
    ModelSource,
    SourceKind,
    is_source_url,
    parse_model_source,
)
from heteroflow.logs import register_secrets
from heteroflow.models.fetch.manifest import SourceFailed
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.schemas.nodes import TaskAssignment

log = logging.getLogger(__name__)

__all__ = ["fetch_model", "for_launch", "needs_fetch", "resolver_for", "token_for"]


def token_for(
    agent: AgentState, source: ModelSource, assigned: str | None = None
) -> str | None:
    """The hub token for ``source``: for the hubs only, never for a web server. The one
    the claim ``assigned`` (the task's tenant's own, else the platform's: H9) first, else
    the node's ``hub_token`` (a pull an operator asks for has none assigned)."""
    if source.kind is SourceKind.URL:
        return None
    if assigned:
        register_secrets(assigned)  # never in this agent's log lines
        return assigned
    return agent.settings.hub_token.get_secret_value() or None


def resolver_for(agent: AgentState) -> SourceResolver:
    """The node's resolver: the operator's hub endpoints and timeout, the agent's session."""
    return SourceResolver(
        hf_endpoint=agent.settings.hf_endpoint,
        modelscope_endpoint=agent.settings.modelscope_endpoint,
        timeout_s=agent.settings.model_resolve_timeout_s,
        session=agent._session(),
    )


def needs_fetch(t: TaskAssignment) -> bool:
    """Whether ``t``'s model is a source to fetch (not a path on the node)."""
    return bool(t.model_path) and not t.model_fetched and is_source_url(t.model_path)


def progress_text(doing: str, p: Progress) -> str:
    """``doing`` ("fetching model hf://…", "copying model … from node b") and how far."""
    total = f" of {size_text(p.total_bytes)}" if p.total_bytes else ""
    rate = f" at {size_text(int(p.rate_bps))}/s" if p.rate_bps > 0 else ""
    eta = f", ~{_duration(p.eta_s)} left" if p.eta_s is not None else ""
    return f"{doing}: {size_text(p.done_bytes)}{total}{rate}{eta}"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


async def fetch_model(agent: AgentState, t: TaskAssignment) -> TaskAssignment:
    """``t`` with ``model_path`` the cache entry of its fetched source (the same ``t`` when
    its model is a path). Raises ``LaunchFailed`` with the source's reason."""
    if not needs_fetch(t):
        return t
    try:
        source = parse_model_source(t.model_path)
    except ValidationFailed as exc:
        raise LaunchFailed(f"model source refused: {exc}") from exc
    token = token_for(agent, source, t.hub_token)
    started = agent.clock.monotonic()
    every = agent.settings.image_pull_report_interval_s
    shown = source.text
    cache = agent.model_cache
    try:
        tries = await ways(agent, source, token, list(t.model_peers), resolver_for(agent))
        manifest = tries[0].manifest
        key = manifest.cache_key
        fresh = not cache.is_complete(key)
        if fresh:
            size = size_text(manifest.total_bytes) if manifest.sizes_known else "size unknown"
            await agent._report(
                t.id, "starting", f"fetching model {shown} ({size}, {len(manifest.files)} "
                f"file(s), revision {manifest.revision or 'none'}{_said(tries[0])})",
                note="fetch",
            )
        elif tries[0].said:  # the origin could not be asked: say which copy runs
            await agent._report(t.id, "starting", f"model {shown}: {tries[0].said}",
                                note="fetch")
        cache.acquire(key)
        try:
            way = await _fetch(agent, t.id, shown, tries, every)
        except BaseException:
            cache.release(key)
            raise
    except SourceFailed as exc:
        raise LaunchFailed(f"model {shown} not fetched ({exc.reason}): {exc}") from exc
    previous = agent.fetched.pop(t.id, None)
    if previous is not None:  # a relaunch on this node: the earlier pin is replaced
        agent.model_cache.release(previous[0])
    entry = cache.entry_path(way.manifest)
    agent.fetched[t.id] = (key, entry)
    if fresh:
        took = agent.clock.monotonic() - started
        log.info("task %s: model %s fetched in %.1f s%s", t.id, shown, took, _said(way))
        await agent._report(
            t.id, "starting", f"fetched model {shown}: {size_text(way.manifest.total_bytes)} "
            f"in {took:.0f} s{_said(way)}", note="fetch",
        )
    return with_fetched(t, entry)


def _said(way: Way) -> str:
    return f", {way.said}" if way.said else ""


async def _fetch(agent: AgentState, task_id: str, shown: str, tries: list[Way],
                 every: float) -> Way:
    """``fetch_first`` with the task's progress notes (at most every ``every`` s)."""
    last = [agent.clock.monotonic()]

    def noting(way: Way) -> ProgressCallback:
        verb = f"copying model {shown} from node {way.manifest.copied_from}" \
            if way.manifest.copied_from else f"fetching model {shown}"

        def noted(p: Progress) -> None:
            now = agent.clock.monotonic()
            if now - last[0] >= every:
                last[0] = now
                agent.note_later(task_id, progress_text(verb, p), "fetching")
        return noted

    return await fetch_first(agent.model_cache, tries, noting, f"task {task_id}: model {shown}")


def with_fetched(t: TaskAssignment, entry: Path) -> TaskAssignment:
    return t.model_copy(update={"model_path": str(entry), "model_fetched": True})


async def for_launch(agent: AgentState, t: TaskAssignment) -> TaskAssignment:
    """What a relaunch (a wake) is given: the entry fetched for ``t`` on this node, or a
    fetch now (after an agent restart: from the cache, when it is still there)."""
    held = agent.fetched.get(t.id)
    if held is not None and needs_fetch(t):
        return with_fetched(t, held[1])
    return await fetch_model(agent, t)
