"""``heteroflow services scale | autoscale | update | window``: change a service that
runs (its replicas, its autoscaling policy, its generation, its schedule window);
``--wait`` follows the change until it lands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import httpx

from heteroflow.cmd import tables
from heteroflow.cmd.errors import CliError
from heteroflow.cmd.remote import check, print_json, session
from heteroflow.cmd.waiting import DONE, follow_group

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


def autoscaling_on(g: Mapping[str, Any]) -> bool:
    return bool((g.get("scale_policy") or {}).get("enabled"))


def widen_to(
    c: httpx.Client, g: Mapping[str, Any], replicas: int, out: TextIO
) -> None:
    """issue 33: ``services scale ID N`` means N replicas. With autoscaling off, the
    bounds are only where a count may be, so an N outside them widens them to N first
    (``PUT .../scale-policy``, the stored policy kept); with autoscaling on, the bounds
    are the autoscaler's range and are not moved behind its back: refused in one line
    that says how to move them."""
    group_id, lo, hi = str(g.get("id")), int(g["min_replicas"]), int(g["max_replicas"])
    if lo <= replicas <= hi:
        return
    if autoscaling_on(g):
        flag = f"--max {replicas}" if replicas > hi else f"--min {replicas}"
        raise CliError(
            f"{replicas} replica(s) is outside the autoscaling range [{lo}, {hi}] of "
            f"{group_id}: widen it with `heteroflow services autoscale {group_id} {flag}`, "
            f"or turn autoscaling off with --disable"
        )
    lo, hi = min(lo, replicas), max(hi, replicas)
    check(c.put(
        f"/api/v1/task-groups/{group_id}/scale-policy",
        json={"enabled": False, "min_replicas": lo, "max_replicas": hi},
    ))
    print(f"replica range of {group_id} widened to {lo}-{hi} (autoscaling is off)", file=out)


def scale_service(
    group_id: str, replicas: int, wait: bool = False, timeout_s: float = 600,
    as_json: bool = False,
) -> None:
    """``PUT .../scale`` (the bounds widened first when autoscaling is off: ``widen_to``);
    with ``wait``, follow it until ``replicas`` replicas run."""
    progress = sys.stderr if as_json else sys.stdout
    with session() as c:
        widen_to(c, check(c.get(f"/api/v1/task-groups/{group_id}")), replicas, progress)
        g = check(c.put(f"/api/v1/task-groups/{group_id}/scale", json={"replicas": replicas}))
        if as_json:
            print_json(g)
        else:
            print(f"scaling {group_id} to {replicas} replica(s) ({tables.replicas(g)} running)")
        if not wait:
            return
        follow_group(
            c, group_id, what=f"{replicas} replica(s) of {group_id} to run",
            timeout_s=timeout_s, outcome=_replicas_outcome(replicas), out=progress,
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
    """``PUT .../scale-policy``: the autoscaling policy and the replica bounds. A body
    without ``enabled`` (only the bounds were given) keeps autoscaling as it is stored:
    the API reads a missing ``enabled`` as "on", which demands a metric (issue 33)."""
    with session() as c:
        if "enabled" not in body:
            stored = check(c.get(f"/api/v1/task-groups/{group_id}"))
            body = {**body, "enabled": autoscaling_on(stored)}
        g = check(c.put(f"/api/v1/task-groups/{group_id}/scale-policy", json=body))
    if as_json:
        print_json(g)
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
            print_json(g)
        else:
            print(
                f"updating {group_id} to generation {generation} "
                f"({body.get('strategy', 'rolling')}): {update_line(g)}"
            )
        if not wait:
            return
        final = follow_group(
            c, group_id, what=f"the update of {group_id} to generation {generation}",
            timeout_s=timeout_s, outcome=_update_outcome(generation), line=update_line,
            out=progress,
        )
        print(f"service {group_id} runs generation {generation}: {update_line(final)}",
              file=progress)


# --- end issue 14 (update) ---


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
        print_json(answer)
        return
    print(f"{group_id}: {window_line(answer)}")
    if mode != "show":
        print("the leader acts on it at its next round (schedule_window_interval_s, 60 s)")
