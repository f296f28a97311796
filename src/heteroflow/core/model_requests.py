"""An operator's pull or eviction of a model on one node's cache (issue 29, H9): the
request's lifecycle and the rules the server and the agent share. Pure.

A request is ``pending`` until the node's agent claims it through its poll (``running``;
a compare-and-set, so one claim wins), then ``done`` or ``failed`` with the agent's
message. The rules:

- A pull takes a model *source* (``hf://``, ``modelscope://``, ``https://``,
  ``fleet://``), never a path: a path names files already on the node, there is nothing
  to pull. One parser decides (``core.model_sources``), with the field named ``source``.
- One open request per (node, action, source or key): a second ``pull`` of a source the
  node is already pulling answers the first request, so an operator's retry (or two
  operators) never starts a second download — the cache would share it anyway, but two
  requests would report one download twice.
- A request is never left open for ever: the agent names, at each poll, the requests it
  still works on (``held``); a ``running`` one it does not name was lost (the agent
  restarted, its claim never arrived) and fails. A request whose node stopped
  heartbeating fails when read. The node's own cache is the truth for what it holds
  (``nodes.models``, from the heartbeat), not these rows.
"""

from __future__ import annotations

from typing import Literal

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.events import EventKind
from heteroflow.core.images import size_text
from heteroflow.core.model_sources import ModelSource, SourceKind, parse_model_source
from heteroflow.core.states import WireEnum

Action = Literal["pull", "evict"]
SOURCE_FIELD = "source"


class ModelRequestStatus(WireEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


S = ModelRequestStatus
OPEN = frozenset({S.PENDING, S.RUNNING})  # the agent may still finish it
# what the agent may report on a running request: progress (running) or its end
Reported = Literal[S.RUNNING, S.DONE, S.FAILED]


def pull_source(text: str) -> ModelSource:
    """The source a pull takes, or ``ValidationFailed`` naming ``source``: the one parser's
    form rules, and no path (a path is on the node already: nothing to pull)."""
    source = parse_model_source(text, SOURCE_FIELD)
    if source.kind is SourceKind.PATH:
        raise ValidationFailed(
            f"{SOURCE_FIELD}: {text!r} is a path: a pull takes a model source "
            "(hf://org/name[@revision], modelscope://org/name[@revision], https://host/path, "
            "fleet://<model id>)",
            field=SOURCE_FIELD,
        )
    return source


def finished_event(action: Action, status: ModelRequestStatus) -> EventKind:
    """The node-level event a finished request writes."""
    if status is S.FAILED:
        return EventKind.NODE_MODEL_REQUEST_FAILED
    return EventKind.NODE_MODEL_PULLED if action == "pull" else EventKind.NODE_MODEL_EVICTED


def what(action: Action, source: str, key: str) -> str:
    """``pull of hf://org/name`` / ``eviction of <key>``: how a message names a request."""
    return f"pull of {source}" if action == "pull" else f"eviction of {key}"


def progress_text(source: str, done_bytes: int, total_bytes: int, rate_bps: float = 0.0,
                  eta_s: float | None = None) -> str:
    """``pulling hf://org/name: 1.2 GB of 4.5 GB at 80 MB/s, ~45 s left``."""
    total = f" of {size_text(total_bytes)}" if total_bytes else ""
    rate = f" at {size_text(int(rate_bps))}/s" if rate_bps > 0 else ""
    left = ""
    if eta_s is not None:
        left = f", ~{eta_s / 60:.0f} min left" if eta_s >= 90 else f", ~{eta_s:.0f} s left"
    return f"pulling {source}: {size_text(done_bytes)}{total}{rate}{left}"
