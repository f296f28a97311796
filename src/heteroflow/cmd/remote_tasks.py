"""``heteroflow tasks`` (show, stop, sleep, wake) and ``heteroflow logs``."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from heteroflow.cmd import tables
from heteroflow.cmd.errors import EXIT_INTERRUPTED, EXIT_PROBLEM, CliError
from heteroflow.cmd.remote import check, get, print_json, session
from heteroflow.cmd.waiting import DONE, ENDED, follow_task


def show_task(task_id: str, as_json: bool = False) -> None:
    get(f"/api/v1/tasks/{task_id}", tables.task_block, as_json)


def _task_line(t: Mapping[str, Any]) -> str:
    message = tables.first_line(t.get("status_message"))
    return str(t.get("status", "?")) + (f" — {message}" if message else "")


def _stop_outcome(t: Mapping[str, Any]) -> str | None:
    status = t.get("status")
    if status in ("stopped", "completed"):
        return DONE
    if status == "failed":
        message = tables.first_line(t.get("status_message"))
        return f"task {t.get('id')} ended failed" + (f": {message}" if message else "")
    return None


def stop_task(task_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Ask a task to stop; with ``wait``, follow it until it has stopped (exit 1 when it
    ends failed instead)."""
    with session() as c:
        t = check(c.post(f"/api/v1/tasks/{task_id}/stop"))
        print(f"stopping {task_id} (now {t.get('status')})")
        if not wait:
            return
        follow_task(
            c, task_id, what=f"task {task_id} to stop", timeout_s=timeout_s,
            outcome=_stop_outcome, line=_task_line,
        )
        print(f"task {task_id} has stopped")


# ---- sleep and wake (F1-F3) --------------------------------------------------------

def wake_text(r: Mapping[str, Any]) -> str:
    """``task-… waking: …``; the branch is named whenever it is not a plain wake."""
    return f"{r.get('task_id')} {r.get('branch', '?')}: {r.get('message', '')}"


def _wake_outcome(t: Mapping[str, Any]) -> str | None:
    status = t.get("status")
    if status == "running":
        return DONE
    if status in ENDED:
        message = tables.first_line(t.get("status_message"))
        return f"task {t.get('id')} ended {status}" + (f": {message}" if message else "")
    return None


def sleep_task(task_id: str, as_json: bool = False) -> None:
    """Put a running inference task to sleep (its engine stops, its memory is freed)."""
    with session() as c:
        t = check(c.post(f"/api/v1/tasks/{task_id}/sleep"))
    if as_json:
        print_json(t)
        return
    print(
        f"{task_id} is {t.get('status')}: its engine stops and its memory is released; "
        f"`heteroflow tasks wake {task_id}` wakes it"
    )


def wake_task(
    task_id: str, wait: bool = False, timeout_s: float = 600, as_json: bool = False
) -> None:
    """Wake a sleeping task; says which way the wake went (F3). With ``wait``, follow it
    until it runs (exit 1 when it fails instead, or the wake could not start)."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        r = check(c.post(f"/api/v1/tasks/{task_id}/wake"))
        if as_json:
            print_json(r)
        else:
            print(wake_text(r))
        if not wait:
            return
        if r.get("branch") in ("container_gone", "failed"):
            raise CliError(f"task {task_id} will not wake: {r.get('message')}", EXIT_PROBLEM)
        follow_task(
            c, task_id, what=f"task {task_id} to run", timeout_s=timeout_s,
            outcome=_wake_outcome, line=_task_line, out=progress,
        )
        print(f"task {task_id} is running", file=progress)


# ---- logs --------------------------------------------------------------------------


def logs(task_id: str, follow: bool = False) -> None:
    """Print a task's output; with ``follow``, keep printing it live until the task ends."""
    after = 0
    with session() as c:
        while True:
            page = check(
                c.get(f"/api/v1/tasks/{task_id}/logs", params={"after": after, "limit": 1000})
            )
            for chunk in page["chunks"]:
                sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            if page["next"] == after:
                break
            after = page["next"]
        if not follow:
            return
        params: dict[str, str | int] = {"after": after, "follow": "true"}
        with c.stream("GET", f"/api/v1/tasks/{task_id}/logs", params=params, timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                check(r)
            try:
                for text in r.iter_text():
                    sys.stdout.write(text)
                    sys.stdout.flush()
            except KeyboardInterrupt:  # the usual way to stop following: no traceback
                raise CliError("stopped following", EXIT_INTERRUPTED) from None
