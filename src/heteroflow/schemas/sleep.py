"""Wire types of sleep and wake (F1-F3): what a wake answers, and the agent's light poll.

A wake is answered with a ``WakeResult`` whatever happens: ``branch`` says which way it
went, never silently (F3). The branches:

- ``waking``: the task is on its way up on its node (it was asleep, or a wake is
  already under way); it reports ``running`` once its health check passes.
- ``already_running``: nothing to do.
- ``starting``: it is not asleep but still being placed or started.
- ``node_offline``: its node is not heartbeating; ``wake_requested`` is recorded, and
  the task wakes when the node is back, or fails (and is rebuilt elsewhere) once the node
  has been gone for ``wake_node_lost_after_s``.
- ``card_borrowed``: a training task borrowed its cards while it slept (F5);
  ``wake_requested`` is recorded and it wakes when that work ends.
- ``container_gone``: the wake found its container gone; the task failed
  (``fault.container_lost``) and the recovery loop rebuilds it.
- ``failed``: it failed for another reason (``message`` says which).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

WakeBranch = Literal[
    "waking",
    "already_running",
    "starting",
    "node_offline",
    "card_borrowed",
    "container_gone",
    "failed",
]

# The branches after which the task is not (yet) on its way up: a wake was recorded and
# waits for its node or its cards, or the task failed.
DEFERRED: frozenset[str] = frozenset({"node_offline", "card_borrowed"})


class WakeResult(BaseModel):
    """The answer to a wake: the task, its status afterwards and which branch it took."""

    task_id: str
    status: str = Field(description="the task's status after the wake")
    branch: WakeBranch
    message: str = Field(description="what happens next, in words")
    wake_requested: bool = Field(
        default=False, description="a wake waiting for its node or its cards (F3)"
    )


class GroupSleepResult(BaseModel):
    """POST /api/v1/task-groups/{id}/sleep: which of its current tasks went to sleep."""

    group_id: str
    slept: list[str] = Field(default_factory=list, description="task ids now sleeping")
    skipped: dict[str, str] = Field(
        default_factory=dict, description="task id -> its status, for tasks not running"
    )


class GroupWakeResult(BaseModel):
    """POST /api/v1/task-groups/{id}/wake: one ``WakeResult`` per current task."""

    group_id: str
    results: list[WakeResult] = Field(default_factory=list)


class NodeTaskLife(BaseModel):
    """The agent's light poll (GET /api/v1/agent/task-life): this node's tasks that
    sleep or wake, so a wake reaches the agent well before its next heartbeat."""

    sleeping: list[str] = Field(default_factory=list)
    waking: list[str] = Field(default_factory=list)
