"""``heteroflow services``: create, list, show, delete, stop, start and restart a
service, and put it to sleep or wake it; ``--wait`` follows it until it lands.
Changing one that runs (scale, autoscale, update, schedule window): ``remote_changes``.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any

from heteroflow.cmd import tables
from heteroflow.cmd.remote import check, get, get_list, print_json, session
from heteroflow.cmd.remote_tasks import wake_text
from heteroflow.cmd.waiting import DONE, ENDED, follow_group, wait_for


def create_service(
    body: dict[str, Any], wait: bool, timeout_s: float = 600, as_json: bool = False
) -> None:
    """Create; with ``wait``, follow it until it runs (exit 1: it failed or stopped, or
    ``timeout_s`` passed). With ``as_json`` the answer goes to stdout, progress to stderr."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        g = check(c.post("/api/v1/task-groups", json=body))
        if as_json:
            print_json(g)
        else:
            print(f"created {g['id']} (endpoint {g.get('endpoint') or tables.EMPTY})")
            if g.get("model_name"):  # issue 33: what clients put in "model"
                print(f"model name to call: {g['model_name']}")
            if g.get("api_key"):
                print(f"API key (shown once): {g['api_key']}")
        for w in g.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
        if not wait:
            return
        group_id = g["id"]
        final = follow_group(
            c, group_id, what=f"service {group_id} to run", timeout_s=timeout_s, out=progress
        )
        print(f"service {group_id} is {final.get('status')}", file=progress)


def list_services(as_json: bool = False) -> None:
    get_list("/api/v1/task-groups", tables.services_table, as_json, "services")


def show_service(group_id: str, as_json: bool = False) -> None:
    get(f"/api/v1/task-groups/{group_id}", tables.service_block, as_json)


def _tasks_line(tasks: list[Mapping[str, Any]]) -> str:
    ended = sum(1 for t in tasks if t.get("status") in ENDED)
    counts = Counter(str(t.get("status")) for t in tasks)
    states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return f"{ended}/{len(tasks)} tasks ended ({states})"


def delete_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Delete; with ``wait``, follow its tasks until every one has stopped."""
    with session() as c:
        task_ids = []
        if wait:
            g = check(c.get(f"/api/v1/task-groups/{group_id}"))
            task_ids = [str(t["id"]) for t in g.get("tasks", [])]
        check(c.delete(f"/api/v1/task-groups/{group_id}"))
        print(f"deleted {group_id}")
        if not wait or not task_ids:
            return

        def poll() -> Mapping[str, Any]:
            return {"tasks": [check(c.get(f"/api/v1/tasks/{t}")) for t in task_ids]}

        def ended(state: Mapping[str, Any]) -> str | None:
            return DONE if all(t.get("status") in ENDED for t in state["tasks"]) else None

        wait_for(
            poll,
            line=lambda state: _tasks_line(state["tasks"]),
            outcome=ended,
            timeout_s=timeout_s,
            what=f"the tasks of {group_id} to stop",
        )
        print(f"every task of {group_id} has stopped")


# --- issue 13: stop / start / restart a service (its desired state) ---


def _stopped_outcome(g: Mapping[str, Any]) -> str | None:
    return DONE if g.get("status") == "stopped" else None


def stop_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Stop a service (it stays stopped: the recovery loop leaves it alone); with
    ``wait``, follow it until every task has stopped."""
    with session() as c:
        g = check(c.post(f"/api/v1/task-groups/{group_id}/stop"))
        print(f"stopping {group_id} (now {g.get('status')})")
        if wait:
            follow_group(
                c, group_id, what=f"service {group_id} to stop", timeout_s=timeout_s,
                outcome=_stopped_outcome,
            )
            print(f"service {group_id} is stopped")


def start_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Start a stopped or failed service; with ``wait``, follow it until it runs
    (exit 1: it failed or stopped, or ``timeout_s`` passed)."""
    with session() as c:
        g = check(c.post(f"/api/v1/task-groups/{group_id}/start"))
        print(f"starting {group_id} (now {g.get('status')})")
        if wait:
            final = follow_group(
                c, group_id, what=f"service {group_id} to run", timeout_s=timeout_s
            )
            print(f"service {group_id} is {final.get('status')}")


def restart_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Stop, then start: every task is replaced by a fresh one (the engines that were
    stopping give their cards to the new tasks as they finish)."""
    with session() as c:
        check(c.post(f"/api/v1/task-groups/{group_id}/stop"))
        g = check(c.post(f"/api/v1/task-groups/{group_id}/start"))
        print(f"restarting {group_id} (now {g.get('status')})")
        if wait:
            final = follow_group(
                c, group_id, what=f"service {group_id} to run", timeout_s=timeout_s
            )
            print(f"service {group_id} is {final.get('status')}")



# ---- sleep and wake (F1-F3) --------------------------------------------------------


def sleep_service(group_id: str, as_json: bool = False) -> None:
    """Put every running task of a service to sleep."""
    with session() as c:
        r = check(c.post(f"/api/v1/task-groups/{group_id}/sleep"))
    if as_json:
        print_json(r)
        return
    slept = list(r.get("slept") or [])
    skipped = dict(r.get("skipped") or {})
    listed = f" ({', '.join(slept)})" if slept else ""
    print(f"{group_id}: {len(slept)} task(s) put to sleep{listed}")
    for task, status in skipped.items():
        print(f"  {task} left as it is ({status})")


def wake_service(
    group_id: str, wait: bool = False, timeout_s: float = 600, as_json: bool = False
) -> None:
    """Wake every task of a service; one line per task naming its branch. With ``wait``,
    follow the service until it runs."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        r = check(c.post(f"/api/v1/task-groups/{group_id}/wake"))
        results = list(r.get("results") or [])
        if as_json:
            print_json(r)
        else:
            if not results:
                print(f"{group_id}: no task to wake")
            for one in results:
                print(wake_text(one))
        if not wait:
            return
        final = follow_group(
            c, group_id, what=f"service {group_id} to run", timeout_s=timeout_s, out=progress
        )
        print(f"service {group_id} is {final.get('status')}", file=progress)
