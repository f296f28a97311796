"""Following a change until it lands: ``wait_for`` polls and prints each new state;
``follow_group`` / ``follow_task`` poll one service or task through the API; and the
lines and outcomes a service's wait shares between commands.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import httpx

from heteroflow.cmd import tables
from heteroflow.cmd.errors import EXIT_INTERRUPTED, EXIT_PROBLEM, CliError
from heteroflow.cmd.remote import check

POLL_S = 0.5

# what a wait's ``outcome`` says: keep polling (None), done, or ended badly
DONE = "done"
ENDED = frozenset({"stopped", "failed", "completed"})  # a task's terminal states


def wait_for(
    poll: Callable[[], Mapping[str, Any]],
    *,
    line: Callable[[Mapping[str, Any]], str],
    outcome: Callable[[Mapping[str, Any]], str | None],
    timeout_s: float,
    what: str,
    out: TextIO | None = None,
) -> Mapping[str, Any]:
    """Poll until ``outcome`` decides; print ``  [12s] line`` whenever the line changes.

    ``outcome`` returns None (keep waiting), ``DONE``, or the message of a wait that
    ended badly (exit 1). Past ``timeout_s``: exit 1, saying where it stood."""
    stream = out or sys.stdout
    start, last = time.monotonic(), ""
    try:
        while True:
            current = poll()
            text = line(current)
            if text != last:  # a pending reason that changes is news too
                print(f"  [{time.monotonic() - start:.0f}s] {text}", file=stream, flush=True)
                last = text
            verdict = outcome(current)
            if verdict == DONE:
                return current
            if verdict is not None:
                raise CliError(verdict, EXIT_PROBLEM)
            if time.monotonic() - start >= timeout_s:
                raise CliError(
                    f"timed out after {timeout_s:g} s waiting for {what} (now: {text})",
                    EXIT_PROBLEM,
                )
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        raise CliError(
            f"interrupted while waiting for {what} (it goes on without the CLI)",
            EXIT_INTERRUPTED,
        ) from None


def group_line(g: Mapping[str, Any]) -> str:
    """``starting — loading model``; with several replicas, how many run."""
    text = str(g.get("status", "?"))
    if len(g.get("tasks") or []) > 1 or int(g.get("current_replicas") or 1) > 1:
        text += f" ({tables.replicas(g)} running)"
    reason = tables.group_reason(g)
    return text + (f" — {reason}" if reason else "")


def group_outcome(g: Mapping[str, Any]) -> str | None:
    """Done when the service runs (or completed); ended badly when it failed or stopped."""
    status = g.get("status")
    if status in ("running", "completed"):
        return DONE
    if status in ("failed", "stopped"):
        reason = tables.group_reason(g)
        return f"service {g.get('id')} ended {status}" + (f": {reason}" if reason else "")
    return None



Outcome = Callable[[Mapping[str, Any]], str | None]


def follow_group(
    c: httpx.Client,
    group_id: str,
    *,
    what: str,
    timeout_s: float,
    outcome: Outcome = group_outcome,
    line: Callable[[Mapping[str, Any]], str] = group_line,
    out: TextIO | None = None,
) -> Mapping[str, Any]:
    """Follow service ``group_id`` until ``outcome`` decides; ``what`` completes "waiting
    for …" (e.g. "service tg-1 to run") and the hint to look at it follows."""
    return wait_for(
        lambda: check(c.get(f"/api/v1/task-groups/{group_id}")),
        line=line,
        outcome=outcome,
        timeout_s=timeout_s,
        what=f"{what}; see `heteroflow services show {group_id}`",
        out=out,
    )


def follow_task(
    c: httpx.Client,
    task_id: str,
    *,
    what: str,
    timeout_s: float,
    outcome: Outcome,
    line: Callable[[Mapping[str, Any]], str],
    out: TextIO | None = None,
) -> Mapping[str, Any]:
    """Follow task ``task_id`` until ``outcome`` decides."""
    return wait_for(
        lambda: check(c.get(f"/api/v1/tasks/{task_id}")),
        line=line,
        outcome=outcome,
        timeout_s=timeout_s,
        what=what,
        out=out,
    )
