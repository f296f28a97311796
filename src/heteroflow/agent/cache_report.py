"""What the heartbeat says of the node's model cache (issue 29 item 3): the scheduler
prefers a node that holds a task's model, and the dry run names where copies exist.

``cache_report`` lists the complete models and the downloads in progress
(``ModelCache.list()``): key, canonical source text, revision, bytes (on disk, or
fetched so far), state. Bounded: downloads first, then complete models most recently
used first, at most ``MAX_CACHED_MODELS``. A node that never fetched has no cache folder,
and reporting makes none (the ``model_cache`` property would). An entry whose source
does not parse as a remote source (a marker edited by hand) is left out, so one bad
marker never costs the node its heartbeat; the source of one that does parse is a URL
the platform accepted, which carries no credential (no user info, no query).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from heteroflow.schemas.nodes import MAX_CACHED_MODELS, CachedModelWire

if TYPE_CHECKING:
    from heteroflow.agent.state import AgentState


def cache_root(state: AgentState) -> Path:
    return state.settings.model_cache_dir or state.settings.work_dir / "models"


def cache_report(state: AgentState) -> list[CachedModelWire]:
    if state._model_cache is None and not cache_root(state).is_dir():
        return []  # never fetched here: no folder made just to say it is empty
    try:
        listed = state.model_cache.list()
    except OSError:  # the folder went away or cannot be read: nothing to offer
        return []
    downloading = [m for m in listed if m.state == "downloading"]
    complete = [m for m in reversed(listed) if m.state == "complete"]  # newest use first
    out: list[CachedModelWire] = []
    for m in downloading + complete:
        if len(out) >= MAX_CACHED_MODELS:
            break
        try:
            out.append(CachedModelWire(key=m.key, source=m.source, revision=m.revision,
                                       size_bytes=m.bytes, state=m.state))
        except ValidationError:
            continue
    return out
