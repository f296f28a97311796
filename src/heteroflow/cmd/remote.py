"""CLI commands that talk to a server's management API (login, services, tenants...).

Every failure is a ``CliError``: one line for stderr and an exit code (see
``cmd/errors.py``): 1 when the server said no or a wait ended badly, 2 when the server
cannot be reached or the CLI is not logged in. What the commands print is rendered by
``cmd/tables.py``; ``--json`` prints the API's answer unchanged instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import httpx

from heteroflow.cmd import tables
from heteroflow.cmd.errors import EXIT_INTERRUPTED, EXIT_PROBLEM, EXIT_UNREACHABLE, CliError
from heteroflow.settings import default_data_dir

__all__ = ["CliError"]

CLI_FILE = "cli.json"
DEFAULT_SERVER = "http://127.0.0.1:3333"
POLL_S = 0.5
NOT_LOGGED_IN = "not logged in: run `heteroflow login --server URL` first"

Render = Callable[[Any], str]


def _state_path() -> Path:
    return Path(os.environ.get("HETEROFLOW_CLI_DIR", str(default_data_dir()))) / CLI_FILE


def save_login(server: str, token: str) -> None:
    path = _state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"server": server, "token": token}))
    path.chmod(0o600)


def _state() -> dict[str, str]:
    path = _state_path()
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(
            f"cannot read {path} ({type(exc).__name__}): run `heteroflow login` again",
            EXIT_UNREACHABLE,
        ) from None
    return {str(k): str(v) for k, v in state.items()} if isinstance(state, dict) else {}


def _client(server: str | None = None) -> httpx.Client:
    state = _state()
    base = server or state.get("server") or DEFAULT_SERVER
    token = state.get("token", "")
    if not token:
        raise CliError(NOT_LOGGED_IN, EXIT_UNREACHABLE)
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _unreachable(url: str, exc: httpx.TransportError) -> CliError:
    why = str(exc) or type(exc).__name__
    return CliError(f"cannot reach the server at {url.rstrip('/')}: {why}", EXIT_UNREACHABLE)


@contextmanager
def session() -> Iterator[httpx.Client]:
    """The logged-in client; a connection failure anywhere inside is one line, exit 2."""
    client = _client()
    try:
        with client:
            yield client
    except httpx.TransportError as exc:
        raise _unreachable(str(client.base_url), exc) from None


def check(r: httpx.Response, *, relogin: bool = True) -> Any:
    """The answer's JSON, or a CliError with the API's message (a 401 on a logged-in
    call means the session ended: exit 2 and say to log in again)."""
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            where = f" (field: {err['field']})" if err.get("field") else ""
            message = f"error {r.status_code}: {err['message']}{where}"
        except (ValueError, KeyError, TypeError):
            message = f"error {r.status_code}: {r.text[:300]}"
        if r.status_code == 401 and relogin:
            raise CliError(f"{message}: run `heteroflow login` again", EXIT_UNREACHABLE)
        raise CliError(message)
    if not r.content:
        return None
    try:
        return r.json()
    except ValueError:
        raise CliError(
            f"{r.request.url} answered with something that is not JSON: "
            "is that a HeteroFlow server?"
        ) from None


def login(server: str, username: str, password: str) -> None:
    server = server.rstrip("/")
    try:
        r = httpx.post(
            f"{server}/api/v1/auth/login",
            json={"username": username, "password": password},
            timeout=30,
        )
    except httpx.TransportError as exc:
        raise _unreachable(server, exc) from None
    save_login(server, check(r, relogin=False)["access_token"])
    print(f"logged in to {server} as {username}")


def _print_json(answer: Any, out: TextIO | None = None) -> None:
    print(json.dumps(answer, indent=2), file=out or sys.stdout)


def show(answer: Any, render: Render, as_json: bool) -> None:
    """The API's answer: as JSON (unchanged), or rendered for people (an answer of a
    shape the renderer does not know is printed field by field)."""
    if as_json:
        _print_json(answer)
    else:
        print(render(answer) if isinstance(answer, dict) else tables.generic_block(answer))


def show_list(answer: Any, render: Render, as_json: bool, what: str) -> None:
    if as_json:
        _print_json(answer)
    elif not isinstance(answer, list):
        raise CliError(f"expected a list of {what} from the server, got: {str(answer)[:200]}")
    elif not answer:
        print(f"no {what}")
    else:
        print(render(answer))


# ---- plain calls -------------------------------------------------------------------


def get(path: str, render: Render = tables.generic_block, as_json: bool = False) -> Any:
    with session() as c:
        answer = check(c.get(path))
    show(answer, render, as_json)
    return answer


def get_list(path: str, render: Render, as_json: bool, what: str) -> Any:
    with session() as c:
        answer = check(c.get(path))
    show_list(answer, render, as_json, what)
    return answer


def post(
    path: str, body: dict[str, Any], render: Render = tables.generic_block, as_json: bool = False
) -> Any:
    with session() as c:
        answer = check(c.post(path, json=body))
    show(answer, render, as_json)
    return answer


def patch(
    path: str, body: dict[str, Any], render: Render = tables.generic_block, as_json: bool = False
) -> Any:
    return _send("PATCH", path, body, render, as_json)


def put(
    path: str, body: dict[str, Any], render: Render = tables.generic_block, as_json: bool = False
) -> Any:
    return _send("PUT", path, body, render, as_json)


def _send(method: str, path: str, body: dict[str, Any], render: Render, as_json: bool) -> Any:
    with session() as c:
        answer = check(c.request(method, path, json=body))
    show(answer, render, as_json)
    return answer


def delete(path: str, render: Render = tables.generic_block, as_json: bool = False) -> None:
    """DELETE; prints the answer when there is one, else what was deleted."""
    with session() as c:
        answer = check(c.delete(path))
    if answer is None:
        print(f"deleted {path}")
    else:
        show(answer, render, as_json)


# ---- waiting -----------------------------------------------------------------------

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


def _group_outcome(g: Mapping[str, Any]) -> str | None:
    status = g.get("status")
    if status in ("running", "completed"):
        return DONE
    if status in ("failed", "stopped"):
        reason = tables.group_reason(g)
        return f"service {g.get('id')} ended {status}" + (f": {reason}" if reason else "")
    return None


# ---- services ----------------------------------------------------------------------


def create_service(
    body: dict[str, Any], wait: bool, timeout_s: float = 600, as_json: bool = False
) -> None:
    """Create; with ``wait``, follow it until it runs (exit 1: it failed or stopped, or
    ``timeout_s`` passed). With ``as_json`` the answer goes to stdout, progress to stderr."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        g = check(c.post("/api/v1/task-groups", json=body))
        if as_json:
            _print_json(g)
        else:
            print(f"created {g['id']} (endpoint {g.get('endpoint') or tables.EMPTY})")
            if g.get("api_key"):
                print(f"API key (shown once): {g['api_key']}")
        for w in g.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
        if not wait:
            return
        group_id = g["id"]
        final = wait_for(
            lambda: check(c.get(f"/api/v1/task-groups/{group_id}")),
            line=group_line,
            outcome=_group_outcome,
            timeout_s=timeout_s,
            what=f"service {group_id} to run; see `heteroflow services show {group_id}`",
            out=progress,
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


def _follow(
    c: httpx.Client,
    group_id: str,
    outcome: Callable[[Mapping[str, Any]], str | None],
    timeout_s: float,
    what: str,
) -> Mapping[str, Any]:
    return wait_for(
        lambda: check(c.get(f"/api/v1/task-groups/{group_id}")),
        line=group_line,
        outcome=outcome,
        timeout_s=timeout_s,
        what=f"service {group_id} {what}; see `heteroflow services show {group_id}`",
    )


def stop_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Stop a service (it stays stopped: the recovery loop leaves it alone); with
    ``wait``, follow it until every task has stopped."""
    with session() as c:
        g = check(c.post(f"/api/v1/task-groups/{group_id}/stop"))
        print(f"stopping {group_id} (now {g.get('status')})")
        if wait:
            _follow(c, group_id, _stopped_outcome, timeout_s, "to stop")
            print(f"service {group_id} is stopped")


def start_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Start a stopped or failed service; with ``wait``, follow it until it runs
    (exit 1: it failed or stopped, or ``timeout_s`` passed)."""
    with session() as c:
        g = check(c.post(f"/api/v1/task-groups/{group_id}/start"))
        print(f"starting {group_id} (now {g.get('status')})")
        if wait:
            final = _follow(c, group_id, _group_outcome, timeout_s, "to run")
            print(f"service {group_id} is {final.get('status')}")


def restart_service(group_id: str, wait: bool = False, timeout_s: float = 600) -> None:
    """Stop, then start: every task is replaced by a fresh one (the engines that were
    stopping give their cards to the new tasks as they finish)."""
    with session() as c:
        check(c.post(f"/api/v1/task-groups/{group_id}/stop"))
        g = check(c.post(f"/api/v1/task-groups/{group_id}/start"))
        print(f"restarting {group_id} (now {g.get('status')})")
        if wait:
            final = _follow(c, group_id, _group_outcome, timeout_s, "to run")
            print(f"service {group_id} is {final.get('status')}")


# --- end issue 13 (stop / start / restart) ---


# --- issue 14: scale and autoscale (I1, I2) ---


def _replicas_outcome(n: int) -> Callable[[Mapping[str, Any]], str | None]:
    """Done when the service's ``n`` current replicas all run (the ones leaving are no
    longer listed); a service that failed or stopped ends the wait badly."""

    def outcome(g: Mapping[str, Any]) -> str | None:
        tasks = g.get("tasks") or []
        if len(tasks) == n and all(t.get("status") == "running" for t in tasks):
            return DONE
        status = g.get("status")
        if status in ("failed", "stopped"):
            reason = tables.group_reason(g)
            return f"service {g.get('id')} ended {status}" + (f": {reason}" if reason else "")
        return None

    return outcome


def scale_service(
    group_id: str, replicas: int, wait: bool = False, timeout_s: float = 600,
    as_json: bool = False,
) -> None:
    """``PUT .../scale``; with ``wait``, follow it until ``replicas`` replicas run."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        g = check(c.put(f"/api/v1/task-groups/{group_id}/scale", json={"replicas": replicas}))
        if as_json:
            _print_json(g)
        else:
            print(f"scaling {group_id} to {replicas} replica(s) ({tables.replicas(g)} running)")
        if not wait:
            return
        wait_for(
            lambda: check(c.get(f"/api/v1/task-groups/{group_id}")),
            line=group_line,
            outcome=_replicas_outcome(replicas),
            timeout_s=timeout_s,
            what=f"{replicas} replica(s) of {group_id} to run; see "
            f"`heteroflow services show {group_id}`",
            out=progress,
        )
        print(f"service {group_id} runs {replicas} replica(s)", file=progress)


def policy_line(g: Mapping[str, Any]) -> str:
    """``autoscaling on: inflight target 4 per replica; replicas 1-3 (now 2)``."""
    p = g.get("scale_policy") or {}
    if p.get("metric"):
        state = "on" if p.get("enabled") else "off"
        text = f"autoscaling {state}: {p['metric']} target {p.get('target')} per replica"
    else:
        text = "autoscaling off"
    return (
        f"{text}; replicas {g.get('min_replicas')}-{g.get('max_replicas')} "
        f"(now {g.get('current_replicas')})"
    )


def autoscale_service(group_id: str, body: dict[str, Any], as_json: bool = False) -> None:
    """``PUT .../scale-policy``: the autoscaling policy and the replica bounds."""
    with session() as c:
        g = check(c.put(f"/api/v1/task-groups/{group_id}/scale-policy", json=body))
    if as_json:
        _print_json(g)
    else:
        print(f"{group_id}: {policy_line(g)}")


# --- end issue 14 (scale and autoscale) ---


# --- issue 14: rolling update / recreate (J1, J2) ---


def update_line(g: Mapping[str, Any]) -> str:
    """``batch 1/2 (rank 0): new generation starting (attempt 1 of 4)``: where the update
    stands, as the server words it."""
    state = str(g.get("rolling_update_state") or "?")
    message = tables.first_line(g.get("rolling_update_message")) or state
    return message if state in ("rolling", "recreating") else f"{state}: {message}"


def _update_outcome(generation: int) -> Callable[[Mapping[str, Any]], str | None]:
    def outcome(g: Mapping[str, Any]) -> str | None:
        if int(g.get("current_generation") or 0) != generation:
            return f"another update (generation {g.get('current_generation')}) started"
        state = g.get("rolling_update_state")
        if state == "done":
            return DONE
        if state == "failed":
            return f"the update to generation {generation} failed: " + str(
                g.get("rolling_update_message") or "no reason given"
            )
        return None

    return outcome


def update_service(
    group_id: str,
    body: dict[str, Any],
    wait: bool = False,
    timeout_s: float = 600,
    as_json: bool = False,
) -> None:
    """Start an update (``PUT .../update``); with ``wait``, follow its batches until it is
    done (exit 1: it failed — rolled back — or ``timeout_s`` passed)."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        g = check(c.put(f"/api/v1/task-groups/{group_id}/update", json=body))
        generation = int(g.get("current_generation") or 0)
        if as_json:
            _print_json(g)
        else:
            print(
                f"updating {group_id} to generation {generation} "
                f"({body.get('strategy', 'rolling')}): {update_line(g)}"
            )
        if not wait:
            return
        final = wait_for(
            lambda: check(c.get(f"/api/v1/task-groups/{group_id}")),
            line=update_line,
            outcome=_update_outcome(generation),
            timeout_s=timeout_s,
            what=f"the update of {group_id} to generation {generation}; see "
            f"`heteroflow services show {group_id}`",
            out=progress,
        )
        print(f"service {group_id} runs generation {generation}: {update_line(final)}",
              file=progress)


# --- end issue 14 (update) ---


# ---- tasks -------------------------------------------------------------------------


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
        wait_for(
            lambda: check(c.get(f"/api/v1/tasks/{task_id}")),
            line=_task_line,
            outcome=_stop_outcome,
            timeout_s=timeout_s,
            what=f"task {task_id} to stop",
        )
        print(f"task {task_id} has stopped")


# ---- sleep and wake (F1-F3) --------------------------------------------------------

def _wake_text(r: Mapping[str, Any]) -> str:
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
        _print_json(t)
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
            _print_json(r)
        else:
            print(_wake_text(r))
        if not wait:
            return
        if r.get("branch") in ("container_gone", "failed"):
            raise CliError(f"task {task_id} will not wake: {r.get('message')}", EXIT_PROBLEM)
        wait_for(
            lambda: check(c.get(f"/api/v1/tasks/{task_id}")),
            line=_task_line,
            outcome=_wake_outcome,
            timeout_s=timeout_s,
            what=f"task {task_id} to run",
            out=progress,
        )
        print(f"task {task_id} is running", file=progress)


def sleep_service(group_id: str, as_json: bool = False) -> None:
    """Put every running task of a service to sleep."""
    with session() as c:
        r = check(c.post(f"/api/v1/task-groups/{group_id}/sleep"))
    if as_json:
        _print_json(r)
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
            _print_json(r)
        else:
            if not results:
                print(f"{group_id}: no task to wake")
            for one in results:
                print(_wake_text(one))
        if not wait:
            return
        final = wait_for(
            lambda: check(c.get(f"/api/v1/task-groups/{group_id}")),
            line=group_line,
            outcome=_group_outcome,
            timeout_s=timeout_s,
            what=f"service {group_id} to run; see `heteroflow services show {group_id}`",
            out=progress,
        )
        print(f"service {group_id} is {final.get('status')}", file=progress)


# --- issue 14 (K1): schedule windows ---


def window_line(w: Mapping[str, Any]) -> str:
    """``runs mon-fri 08:00-20:00 Europe/Berlin; outside: paused (...)`` and where it
    stands now, from a ``ScheduleWindowRead``."""
    text = str(w.get("summary") or "no window")
    at = w.get("changes_at")
    if w.get("inside") is True:
        text += "\nnow: inside the window" + (f" (it closes {at})" if at else " (always)")
    elif w.get("inside") is False:
        text += "\nnow: outside the window" + (f" (it opens {at})" if at else "")
    return text


def window_service(
    group_id: str, changes: dict[str, Any], mode: str = "set", as_json: bool = False
) -> None:
    """Show (``mode`` "show"), change (``set``: ``changes`` over the stored window),
    ``disable``, ``enable`` or ``remove`` a service's schedule window."""
    path = f"/api/v1/task-groups/{group_id}/schedule-window"
    with session() as c:
        if mode == "remove":
            answer = check(c.delete(path))
        else:
            current = check(c.get(path))
            if mode == "show":
                answer = current
            else:
                body = dict(current.get("schedule_window") or {})
                if mode == "set":
                    body.update(changes)
                    if body.get("action", "pause") != "scale":
                        body.pop("replicas", None)
                body["enabled"] = mode != "disable"
                answer = check(c.put(path, json=body))
    if as_json:
        _print_json(answer)
        return
    print(f"{group_id}: {window_line(answer)}")
    if mode != "show":
        print("the leader acts on it at its next round (schedule_window_interval_s, 60 s)")


# --- end issue 14 (K1) ---


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
