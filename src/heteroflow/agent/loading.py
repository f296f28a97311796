"""Start and wake windows that follow loading (FEATURES D5) on the node.

An inference engine launched (or woken) here is inside its load window until its first
passing health check: its failed checks are not counted (``core.health``), its load is
sampled every ``load_sample_interval_s`` (``agent.load_progress``) and judged by
``core.loading``. An engine that makes progress is never stopped for being slow; one
where nothing moved for ``load_stall_s`` (or past the ceiling) is stopped and its task
fails with ``fault.load_stalled`` and the reason ("stalled: no progress for 120 s after
reading 1.2 of 4.5 GB"), which the recovery loop counts as a failed start (E1, E3).

What people see goes through the one door an agent has for a task's news, its report:
a note (``starting`` / ``waking`` with ``note``) at the window's start — the model's
size and the expected time, also an event (``task.loading``) — and every
``load_report_interval_s`` the status message alone ("loading: 1.2 of 4.5 GB, ~3 min
left"). At the first pass the window closes, the running report says how long the load
took, and the node's read rate learns from it. After that D2's rules apply unchanged.

Training and container tasks keep D2's fixed start period: a job that never answers a
health check but keeps reading its data would otherwise never be judged.
"""

from __future__ import annotations

import asyncio
import logging

from heteroflow.agent.load_progress import READ_RATE_FILE, keep_read_rate, model_size
from heteroflow.agent.state import AgentState, Local
from heteroflow.core.loading import MB, LoadVerdict, LoadWatch, size_text

log = logging.getLogger(__name__)

STALLED_FAULT = "load_stalled"


class Loading(AgentState):
    """The agent's part that watches engines load."""

    async def _open_load(self, loc: Local, *, wake: bool) -> None:
        """A launch or a wake of ``loc``'s engine just happened: its load window opens
        (inference only) and the task's status says what loads and for how long."""
        loc.load = None
        if loc.task.task_type != "inference":
            return
        size = await asyncio.to_thread(model_size, loc.task, self.runtime.name, self.config)
        now = self.clock.monotonic()
        loc.load = LoadWatch(
            self.load_policy,
            now,
            grace_s=loc.health.start_period_s,
            expected_bytes=size.bytes,
            rate=self.read_rate,
        )
        loc.load_disk, loc.load_sampled_at, loc.load_noted_at = size.disk, None, now
        self.progress.forget(loc.task.id)
        message = loc.load.start_message("waking" if wake else "loading")
        log.info("task %s: %s", loc.task.id, message)
        await self._report(loc.task.id, _note_status(loc), message, note="loading")

    async def _load_round(self, task_id: str, loc: Local, now: float) -> bool:
        """Sample and judge a loading engine when its sample is due; True when it was
        stopped (stalled, or overdue)."""
        watch = loc.load
        if watch is None:
            return False
        due = loc.load_sampled_at is None or (
            now - loc.load_sampled_at >= self.settings.load_sample_interval_s
        )
        if not due:
            return False
        loc.load_sampled_at = now
        last = loc.tracker.last_detail
        sample = await asyncio.to_thread(
            self.progress.sample, loc.task, now, last, loc.load_disk
        )
        reading = watch.observe(sample)
        if reading.verdict in (LoadVerdict.STALLED, LoadVerdict.OVERDUE):
            reason = reading.stop_reason(watch.policy.stall_s, watch.ceiling_s)
            what = "its wake" if loc.waking else "its launch"
            message = f"{reason} ({what}); last health check: {last or 'none yet'}"
            log.warning("task %s: %s", task_id, message)
            self.progress.forget(task_id)
            await self._stop(task_id, "failed", message, fault=STALLED_FAULT)
            return True
        if now - loc.load_noted_at >= self.settings.load_report_interval_s:
            loc.load_noted_at = now
            await self._report(task_id, _note_status(loc), reading.message(), note="progress")
        return False

    def _close_load(self, loc: Local) -> str:
        """The first pass: the window closes and the node's read rate learns from the
        load; returns what the running report adds ("" when there was no window)."""
        watch, loc.load = loc.load, None
        if watch is None:
            return ""
        self.progress.forget(loc.task.id)
        reading = watch.ready(self.clock.monotonic())
        text = f"loaded in {reading.elapsed_s:.0f} s"
        measured = watch.measured()
        if measured is not None:
            read, seconds = measured
            self.read_rate = self.read_rate.with_load(read, seconds)
            text += f" ({size_text(read)} read at {read / seconds / MB:.0f} MB/s)"
            try:
                keep_read_rate(self.settings.work_dir / READ_RATE_FILE, self.read_rate)
            except OSError as exc:  # kept in memory all the same
                log.warning("the node's read rate was not written: %s", exc)
        return text


def _note_status(loc: Local) -> str:
    return "waking" if loc.waking else "starting"
