"""``services`` (create, lifecycle, update, sleep/wake, scale, autoscale, window) and
``tasks`` (one task of a service)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import (
    MANAGE,
    count,
    json_flag,
    json_progress_flag,
    wait_flags,
)

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers

SERVICES_EPILOG = """\
example:
  heteroflow services create --name chat --model-path qwen2.5-0.5b.gguf --gpus 0"""
SERVICE_ID = "the service id (tg-...)"
TASK_ID = "the task id (task-...)"


def add_parsers(sub: Subparsers) -> None:
    sv = sub.add_parser(
        "services",
        help="create, list, show, delete, stop/start, sleep/wake, scale, update services",
        epilog=SERVICES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    svs = sv.add_subparsers(dest="action", required=True, metavar="ACTION")
    _create(svs)
    _lifecycle(svs)
    _update(svs)
    _sleep_wake_scale(svs)
    _autoscale(svs)
    _window(svs)
    sv.set_defaults(root=MANAGE)
    _tasks(sub)


def volume_arg(text: str) -> dict[str, object]:
    """``HOST:CONTAINER[:ro|rw]`` (as ``docker run -v``) -> a ``task.volumes`` item; the
    server checks the paths."""
    parts = text.split(":")
    mode = "ro"
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        mode = parts.pop()
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give HOST:CONTAINER, optionally :ro (the default) or :rw"
        )
    return {"host_path": parts[0], "container_path": parts[1], "read_only": mode == "ro"}


def _create(svs: Subparsers) -> None:
    c = svs.add_parser("create", help="create a service and (by default) wait until it runs")
    c.add_argument("--name", required=True, help="the service's name (letters, digits, -)")
    c.add_argument(
        "--image",
        default="",
        help="engine image; default: the server picks one from the engines nodes report",
    )
    c.add_argument(
        "--model-path",
        default="",
        help="absolute path on the node, or a name under the node's models directory",
    )
    c.add_argument("--model-name", default=None, help="the model name clients ask for")
    c.add_argument(
        "--gpus", type=count(0, 1024), default=1, help="GPUs per replica; 0 = CPU (default 1)"
    )
    c.add_argument("--engine", default="", help="engine (e.g. llamacpp, vllm); default: chosen")
    c.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="one extra engine argument (repeat it; write --engine-arg=-c for dashes)",
    )
    c.add_argument(
        "--priority",
        type=count(0, 1000),
        default=None,
        help="0-1000, higher first (members: up to their tenant's priority ceiling)",
    )
    c.add_argument(
        "--volume",
        action="append",
        default=[],
        type=volume_arg,
        metavar="HOST:CONTAINER[:ro|rw]",
        help="bind-mount a host folder inside a node's allowed prefixes (repeat it); "
        "read-only unless :rw (Docker nodes only)",
    )
    c.add_argument(
        "--not-preemptible",
        action="store_true",
        help="higher-priority work never stops this service's tasks to take their cards",
    )
    wait_flags(c, "it runs", default=True)
    json_progress_flag(c)


def _lifecycle(svs: Subparsers) -> None:
    """list, show, delete, and (issue 13) the service's desired state."""
    json_flag(svs.add_parser("list", help="every service you may see, as a table"))
    sh = svs.add_parser("show", help="one service: its fields, tasks and why they wait")
    sh.add_argument("id", help=SERVICE_ID)
    json_flag(sh)
    de = svs.add_parser("delete", help="delete a service: its tasks stop")
    de.add_argument("id", help=SERVICE_ID)
    wait_flags(de, "every task has stopped", default=False)
    so = svs.add_parser(
        "stop", help="stop a service; it stays stopped (nothing restarts it) until started"
    )
    so.add_argument("id", help=SERVICE_ID)
    wait_flags(so, "every task has stopped", default=False)
    sa = svs.add_parser(
        "start", help="start a stopped or failed service again (same endpoint and API key)"
    )
    sa.add_argument("id", help=SERVICE_ID)
    wait_flags(sa, "it runs", default=False)
    sr = svs.add_parser("restart", help="stop a service, then start it with fresh tasks")
    sr.add_argument("id", help=SERVICE_ID)
    wait_flags(sr, "it runs", default=False)
    # issue 33: the live series as sparklines
    tp = svs.add_parser("top", help="a service's requests/s, latency, errors... as sparklines")
    tp.add_argument("id", help=SERVICE_ID)
    tp.add_argument("--since", default="15m", help="how far back: 90s, 15m, 6h (≤ 24h)")
    json_flag(tp)


def _update(svs: Subparsers) -> None:
    """issue 14: a new generation (rolling update or recreate)."""
    su = svs.add_parser(
        "update",
        help="roll a service to a new image / engine arguments / environment",
        description="Start a new generation of every replica. rolling (default): batch "
        "by batch, each new replica runs and passes its health check before an old one "
        "drains and stops; a batch that fails is tried 3 more times, then the update "
        "rolls back. recreate: stop every replica, then start every new one.",
    )
    su.add_argument("id", help=SERVICE_ID)
    su.add_argument("--image", default="", help="the new generation's engine image")
    su.add_argument(
        "--engine-arg",
        action="append",
        default=None,
        help="the new generation's engine arguments, one per flag (repeat it; "
        "--engine-arg=-c for dashes); they replace the current ones",
    )
    su.add_argument(
        "--env",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="the new generation's environment (repeat it); it replaces the current one",
    )
    su.add_argument(
        "--strategy",
        choices=("rolling", "recreate"),
        default="rolling",
        help="rolling (default): batch by batch, no downtime; recreate: stop all, start all",
    )
    su.add_argument(
        "--batch-size", type=count(1), default=1, help="rolling: replicas replaced at a time (1)"
    )
    wait_flags(su, "the update is done", default=False)
    json_progress_flag(su)


def _sleep_wake_scale(svs: Subparsers) -> None:
    sl = svs.add_parser(
        "sleep", help="put a service to sleep: engines stop, memory is freed, it stays listed"
    )
    sl.add_argument("id", help=SERVICE_ID)
    json_flag(sl)
    wk = svs.add_parser("wake", help="wake a sleeping service (says why when it must wait)")
    wk.add_argument("id", help=SERVICE_ID)
    wait_flags(wk, "it runs", default=False)
    json_flag(wk)
    # issue 14 (I2)
    sc = svs.add_parser(
        "scale",
        help="set a service's replica count (autoscaling off: its min/max widen to it)",
    )
    sc.add_argument("id", help=SERVICE_ID)
    sc.add_argument("replicas", type=count(1), help="the replica count")
    wait_flags(sc, "that many replicas run", default=False)
    json_flag(sc)


def _autoscale(svs: Subparsers) -> None:
    """issue 14 (I1)."""
    au = svs.add_parser(
        "autoscale",
        help="autoscale a service by a load metric, or --disable it; set min / max replicas",
        description="--metric/--target (or no option) turn autoscaling on; --disable turns "
        "it off; --min/--max alone change only the replica range and leave autoscaling as "
        "it is.",
    )
    au.add_argument("id", help=SERVICE_ID)
    au.add_argument(
        "--metric",
        choices=["inflight", "tokens_per_s", "queue", "kv_cache"],
        default=None,
        help="inflight: requests in flight per replica; tokens_per_s: tokens answered per "
        "second per replica; queue: requests waiting in the engines per replica; "
        "kv_cache: KV-cache use in %% (default: as stored)",
    )
    au.add_argument(
        "--target", type=float, default=None, help="the metric per replica to aim for"
    )
    au.add_argument("--min", type=count(1), default=None, help="min replicas (default: as stored)")
    au.add_argument("--max", type=count(1), default=None, help="max replicas (default: as stored)")
    au.add_argument(
        "--disable", action="store_true", help="turn autoscaling off (the policy is kept)"
    )
    json_flag(au)


def days(text: str) -> list[str]:
    """issue 14 (K1): ``mon-fri,sun`` -> the API's list of days."""
    from heteroflow.core.windows import expand_days

    try:
        return expand_days(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _window(svs: Subparsers) -> None:
    """issue 14 (K1): the schedule window."""
    wn = svs.add_parser(
        "window",
        help="when a service runs: outside its window it is paused, scaled down or stopped",
        description="Show or set a service's schedule window. Outside the window the "
        "leader (every 60 s) pauses the service (its engines sleep; it wakes on a "
        "request), scales it down to --replicas, or stops it; back inside, a pause or "
        "scale is undone (a stop is not: start the service). Options left out keep their "
        "stored values. Without options: show the window.",
    )
    wn.add_argument("id", help=SERVICE_ID)
    wn.add_argument("--start", default=None, metavar="HH:MM", help="local time it opens")
    wn.add_argument(
        "--end", default=None, metavar="HH:MM",
        help="local time it closes (24:00 = midnight; before --start = the next day)",
    )
    wn.add_argument(
        "--timezone", default=None, metavar="ZONE",
        help="IANA time zone, e.g. Europe/Berlin (default UTC)",
    )
    wn.add_argument(
        "--days", type=days, default=None, metavar="DAYS",
        help="days it opens: mon-fri, sat,sun, every (default every day)",
    )
    wn.add_argument(
        "--action", dest="window_action", choices=("pause", "scale", "stop"), default=None,
        help="outside the window (default pause)",
    )
    wn.add_argument(
        "--replicas", type=count(1), default=None, help="scale: the replica count outside"
    )
    wm = wn.add_mutually_exclusive_group()
    wm.add_argument(
        "--disable", action="store_true",
        help="keep the window but stop acting on it (what it has in effect is undone)",
    )
    wm.add_argument("--enable", action="store_true", help="act on the stored window again")
    wm.add_argument("--remove", action="store_true", help="remove the window")
    json_flag(wn)


def _tasks(sub: Subparsers) -> None:
    tk = sub.add_parser("tasks", help="one task of a service: show / stop / sleep / wake")
    tks = tk.add_subparsers(dest="action", required=True, metavar="ACTION")
    ts = tks.add_parser("show", help="one task's fields")
    ts.add_argument("id", help=TASK_ID)
    json_flag(ts)
    tp = tks.add_parser("stop", help="stop one task")
    tp.add_argument("id", help=TASK_ID)
    wait_flags(tp, "it has stopped", default=False)
    tsl = tks.add_parser("sleep", help="put a running inference task to sleep")
    tsl.add_argument("id", help=TASK_ID)
    json_flag(tsl)
    twk = tks.add_parser("wake", help="wake a sleeping task (says why when it must wait)")
    twk.add_argument("id", help=TASK_ID)
    wait_flags(twk, "it runs", default=False)
    json_flag(twk)
    tk.set_defaults(root=MANAGE)
