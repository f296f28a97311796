"""Watching engines: one that exits is reported (with its last output), and the
container-level health checks run (D1-D4); a loading engine is judged by its load until
its first passing check (D5, ``agent.loading``); a waking engine is probed quickly and
reported running at its first passing check (F2).
"""

from __future__ import annotations

import asyncio
import logging
import re

from heteroflow.agent.health_probe import probe
from heteroflow.agent.loading import Loading
from heteroflow.agent.state import Local
from heteroflow.core.clock import interruptible_sleep
from heteroflow.core.gang import serves_api
from heteroflow.core.health import HealthVerdict

log = logging.getLogger(__name__)


def _headless(loc: Local) -> bool:
    """An inference gang's stage past rank 0 (``core.gang.serves_api``): its rank comes
    with every assignment, so a heartbeat's word (which replaces the claim's) keeps it."""
    t = loc.task
    return t.task_type == "inference" and not serves_api(t.parallelism, t.rank)


class Watching(Loading):
    """The agent's part that watches the engines it runs."""

    async def watch_once(self) -> None:
        for task_id, loc in list(self.local.items()):
            if self.local.get(task_id) is not loc:
                continue  # stopped (or replaced) while this round awaited
            code = self.runtime.exit_code(task_id)
            if code is not None:
                await self._exited(task_id, loc, code)
                continue
            now = self.clock.monotonic()
            if await self._load_round(task_id, loc, now):
                continue  # D5: stalled (or overdue), stopped
            if not (loc.tracker.due(now) or self._ready_probe_due(loc, now)):
                continue
            loc.probed_at = now
            if _headless(loc):  # G1: no API to probe; its process is alive (checked above)
                ok, detail = True, "headless pipeline stage: its process runs"
            else:
                host = self.launcher.probe_host_for(loc.task, loc.port)
                ok, detail = await probe(
                    loc.health, host, loc.port, self._session(), key=loc.task.engine_key
                )
            verdict = loc.tracker.record(
                ok, self.clock.monotonic(), detail, loading=loc.load is not None
            )
            loaded = self._close_load(loc) if ok else ""
            if loc.waking and verdict in (HealthVerdict.HEALTHY_FIRST, HealthVerdict.HEALTHY):
                loc.waking, loc.reported_running = False, True
                took = self.clock.monotonic() - loc.woken_at
                await self._report(
                    task_id,
                    "running",
                    f"awake: health check passed {took:.1f} s after its wake"
                    + (f"; {loaded}" if loaded else ""),
                    list(loc.argv) or None,
                )
            elif verdict == HealthVerdict.HEALTHY_FIRST and not loc.reported_running:
                loc.reported_running = True
                message = "health check passed" + (f"; {loaded}" if loaded else "")
                await self._report(task_id, "running", message, list(loc.argv))
            elif verdict in (
                HealthVerdict.IGNORED_IN_START_PERIOD, HealthVerdict.IGNORED_WHILE_LOADING
            ):
                log.debug("task %s: health check failed while it loads: %s", task_id, detail)
            elif verdict == HealthVerdict.FAILING:
                log.warning("task %s: health check failed: %s", task_id, detail)
            elif verdict == HealthVerdict.UNHEALTHY:
                await self._stop(
                    task_id,
                    "failed",
                    f"health check failed {loc.health.unhealthy_threshold} times: {detail}",
                    fault="unhealthy",
                )

    async def _exited(self, task_id: str, loc: Local, code: int) -> None:
        """An engine that exited: its last output shipped, its outcome reported (a
        clean exit completes a non-inference task; anything else fails it)."""
        tail = self.runtime.log_tail(task_id, 20)
        try:
            await self.shipper.ship_once([task_id])  # its last words matter most
        except Exception:
            log.exception("last log round of %s failed", task_id)
        self.shipper.forget(task_id)
        self.runtime.forget(task_id)
        self.local.pop(task_id, None)
        self._release_ports(loc.task)
        await self._keep_doors()
        if code == -1 and self.runtime.name == "docker":
            await self._report(
                task_id,
                "failed",
                "container removed behind the agent's back",
                fault="container_lost",
            )
        elif code == 0 and loc.task.task_type != "inference":
            await self._report(task_id, "completed", "exited with code 0")
        else:
            said = last_words(tail)
            await self._report(
                task_id,
                "failed",
                # issue 33: its last words on the first line, which is what lists and the
                # console's header show; the tail below it
                f"engine exited with code {code}{f': {said}' if said else ''}; "
                f"last output:\n{tail}",
                list(loc.argv),
                # a negative code is a signal: killed behind the agent's back
                fault="engine_exited" if code >= 0 else "container_lost",
            )

    def _ready_probe_due(self, loc: Local, now: float) -> bool:
        """An engine not yet serving — launched and never passed, or waking — is probed
        every ``wake_probe_interval_s`` inside its start period or its load window
        (failures there are never counted), so it serves as soon as it answers; its
        check's own ``interval_seconds`` governs once it has passed. (A launch used to
        wait the whole interval after its first, too-early probe: a tiny model loaded in
        under a second became routable after 10 s — bench/cold_start.py.)"""
        last = loc.probed_at
        return (
            (loc.waking or not loc.tracker.passed_once)
            and not loc.tracker.paused
            and (loc.tracker.in_start_period(now) or loc.load is not None)
            and (last is None or now - last >= self.settings.wake_probe_interval_s)
        )

    async def _watch_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.watch_once()
            except Exception:
                log.exception("watch round failed")
            if await interruptible_sleep(stop, self.settings.watch_interval_s):
                return


_TIMESTAMP = re.compile(r"^[\d.:T\-]+\s+(?:[EWIDF]\s+)?(?:\S+\s+)?")
_ERROR = re.compile(
    r"error|exception|fatal|failed|traceback|refused|denied|not found|out of memory|abort",
    re.IGNORECASE,
)


# llama.cpp's own error-level lines ("0.00.005.248 E llama_model_load: error loading …")
_ENGINE_ERROR = re.compile(r"^[\d.:]+\s+E\s+")


def last_words(tail: str, limit: int = 300) -> str:
    """The line of an engine's last output that says why it stopped: llama.cpp's first
    error-level line (the cause; those after it are its consequences, and the
    launcher's summary says only "Failed to init server"), else a launcher's own
    ``error:`` summary, else the last line that reads like an error, else the last
    non-empty one; without its log prefix, shortened."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    if not lines:
        return ""
    own = [ln for ln in lines if ln.lower().startswith("error:")]  # a launcher's summary
    engine = [ln for ln in lines if _ENGINE_ERROR.match(ln)]
    if engine:
        text = _TIMESTAMP.sub("", engine[0], count=1) or engine[0]
    elif own:
        text = own[-1]
    else:
        pick = next((ln for ln in reversed(lines) if _ERROR.search(ln)), lines[-1])
        text = _TIMESTAMP.sub("", pick, count=1) or pick
    return text if len(text) <= limit else text[: limit - 1] + "…"

