"""A recreate's pre-pull on the node (J2, H7): the new image made present here before the
service's old replicas stop, so that an image that cannot be pulled (or pulls for ten
minutes) never leaves the service with nothing.

The server asks through this agent's own poll (``GET /api/v1/agent/prepulls``, next to
the file requests): per old replica on this node, the image and the pull's login, as a
claim carries it. The pull is the launch's own (``PullsImages.prepare``: one pull per
image per node, shared with launches), in a worker thread; the answer goes back per
replica: ``pulled``, ``failed`` (may heal: the server keeps asking, and it is tried again
after ``RETRY_S``) or ``unavailable`` (not found, unauthorised: the update fails with
nothing stopped). A launcher that pulls nothing (the process runtime runs the node's own
engines) has every image it needs: ``pulled``.
"""

from __future__ import annotations

import asyncio
import logging

from heteroflow.agent.pulling import PullsImages
from heteroflow.agent.runtime.protocol import PullFailed
from heteroflow.agent.state import AgentState
from heteroflow.core.images import PERMANENT
from heteroflow.schemas.prepull import PrepullAsk

log = logging.getLogger(__name__)

#: A failed pull (that may heal) is tried again no sooner than this.
RETRY_S = 30.0


class Prepulls:
    """The pre-pulls under way on this node, and when each last failed."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed_at: dict[tuple[str, str], float] = {}

    async def round(self, agent: AgentState) -> None:
        """Ask the server what to pull and start each pull not under way (or failed too
        recently); answers go back as each pull ends."""
        asks = await agent.client.prepulls()
        now = agent.clock.monotonic()
        wanted = {(a.task_id, a.image) for a in asks}
        for key in [k for k, job in self._running.items() if job.done()]:
            del self._running[key]
        for key in [k for k in self._failed_at if k not in wanted]:
            del self._failed_at[key]
        for a in asks:
            key = (a.task_id, a.image)
            if key in self._running or now - self._failed_at.get(key, -RETRY_S) < RETRY_S:
                continue
            self._running[key] = asyncio.create_task(self._pull(agent, a))

    def cancel(self) -> None:
        for job in self._running.values():
            job.cancel()

    async def wait(self) -> None:
        """Until the pulls under way have answered (tests; shutdown cancels them)."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def _pull(self, agent: AgentState, a: PrepullAsk) -> None:
        launcher = agent.launcher
        loc = agent.local.get(a.task_id)
        if not isinstance(launcher, PullsImages):
            outcome, message = "pulled", f"{a.image}: this node's runtime pulls no images"
        elif loc is None:  # not running here (yet): asked again next round
            return
        else:
            t = loc.task.model_copy(update={"image": a.image, "registry_auth": a.registry_auth})
            try:
                pulled = await asyncio.to_thread(launcher.prepare, t, lambda p: None)
            except PullFailed as exc:
                outcome = "unavailable" if exc.kind in PERMANENT else "failed"
                message = str(exc)
            else:
                outcome = "pulled"
                message = f"{a.image} {'pulled' if pulled else 'already'} on this node"
        if outcome == "failed":
            self._failed_at[(a.task_id, a.image)] = agent.clock.monotonic()
        log.info("pre-pull for task %s: %s (%s)", a.task_id, outcome, message)
        try:
            await agent.client.prepulled(a.task_id, a.image, outcome, message)
        except Exception as exc:  # the server moved on, or is away: asked again if it asks
            self._failed_at[(a.task_id, a.image)] = agent.clock.monotonic()
            log.warning("pre-pull answer for task %s not delivered: %s", a.task_id, exc)
