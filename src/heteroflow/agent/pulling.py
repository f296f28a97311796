"""The agent's side of an image pull (H7): the launch's first step on a runtime that
pulls (Docker), with its progress reported on the task through the agent's report door.

``PullsImages`` is what a launcher that pulls offers (``DockerLauncher.prepare``); the
process launcher has no images and is not one. ``pull_image`` runs the pull in a worker
thread (the Engine API is blocking) and turns its progress into notes on the starting
task: ``pull`` when it begins and when it ends (the task's status message and a
``task.image_pull`` event), ``pulling`` in between, at most every
``image_pull_report_interval_s`` (the status message alone: a 10-minute pull must not
write hundreds of events). Two launches of one image share one pull (the runtime's
``ImagePuller``); each reports on its own task.

A failed pull raises ``PullFailed``: the caller reports the task failed with the status
line it carries; a permanent failure (not found, unauthorised) also names the fault
``image_unavailable``, so recovery does not rebuild it and a rolling update fails at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from heteroflow.agent.state import AgentState
from heteroflow.core.images import PullProgress, size_text
from heteroflow.schemas.nodes import TaskAssignment

log = logging.getLogger(__name__)


@runtime_checkable
class PullsImages(Protocol):
    def prepare(
        self, t: TaskAssignment, progress: Callable[[PullProgress], None]
    ) -> bool:
        """Make the task's image present on the node; True when it had to be pulled.
        Raises ``PullFailed``."""
        ...


async def pull_image(agent: AgentState, t: TaskAssignment) -> None:
    """Pull ``t``'s image if the launcher pulls and the node lacks it (see the module)."""
    launcher = agent.launcher
    if not isinstance(launcher, PullsImages) or not t.image:
        return
    loop = asyncio.get_running_loop()
    every = agent.settings.image_pull_report_interval_s
    started = agent.clock.monotonic()
    last: list[float] = []  # when the last note left (empty: none yet)

    def note(text: str, kind: str) -> None:
        asyncio.run_coroutine_threadsafe(
            agent._report(t.id, "starting", text, note=kind), loop
        )

    def progress(p: PullProgress) -> None:  # in the pull's worker thread
        now = agent.clock.monotonic()
        if not last:
            last.append(now)
            note(f"pulling image {t.image}", "pull")
        elif now - last[0] >= every:
            last[0] = now
            note(p.text(), "pulling")

    sizes: list[PullProgress] = []

    def remember(p: PullProgress) -> None:
        if not sizes:
            sizes.append(p)
        progress(p)

    pulled = await asyncio.to_thread(launcher.prepare, t, remember)
    if pulled:
        took = agent.clock.monotonic() - started
        size = f"{size_text(sizes[0].size)} " if sizes and sizes[0].size else ""
        log.info("task %s: image %s pulled in %.1f s", t.id, t.image, took)
        await agent._report(
            t.id, "starting", f"pulled image {t.image}: {size}in {took:.0f} s", note="pull"
        )
