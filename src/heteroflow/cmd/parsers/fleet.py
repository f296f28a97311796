"""The machines and what runs on them: ``nodes`` and a task's ``logs``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heteroflow.cmd.parsers.common import MANAGE, json_flag

if TYPE_CHECKING:
    from heteroflow.cmd.parsers.common import Subparsers


def add_parsers(sub: Subparsers) -> None:
    nd = sub.add_parser("nodes", help="list nodes: status, GPUs, load")
    json_flag(nd)
    nd.set_defaults(root=MANAGE)

    lo = sub.add_parser("logs", help="print a task's output (-f: follow it live)")
    lo.add_argument("task_id", help="the task id (task-...)")
    lo.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    lo.set_defaults(root=MANAGE)
