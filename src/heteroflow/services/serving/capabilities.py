"""Capabilities of services (issue 15 item 2): what each task group's model can answer.

A task's capabilities come from its engine, the arguments it runs with and its model's
files (:func:`heteroflow.core.engines.capabilities.derive`): the argv the agent reported
at launch (``launch_argv``: the final command line), else a custom ``command``, else its
``engine_args`` plus the tool-call flags the command builder adds for its model family
(so a service shows what it will do before it first starts). A group's are those of its
running tasks merged (during a rolling update two generations may differ: a capability
counts as absent only when every one lacks it), else of its current tasks.

Read by the routing snapshot (the gateway refuses what a model cannot do) and by the
service and model-route read APIs (shown on the route).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.engines import tool_parsers
from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities, derive, merge
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Task
from heteroflow.models.capabilities import model_facts


def task_args(t: Task) -> list[str]:
    """The arguments ``t``'s engine runs (or will run) with."""
    if t.launch_argv:
        return [str(a) for a in t.launch_argv]
    if t.command:
        return [str(a) for a in t.command]
    args = [str(a) for a in t.engine_args]
    return [*args, *tool_parsers.command_args(t.engine, t.model_path, args)]


def task_capabilities(t: Task) -> Capabilities:
    if not t.engine:
        return UNKNOWN
    return derive(t.engine, task_args(t), model_facts(t.model_path))


def of_tasks(tasks: Iterable[Task]) -> Capabilities:
    """A group's capabilities from its tasks (see the module doc); unknown without any."""
    current = [t for t in tasks if not t.replaced_by]
    running = [t for t in current if t.status == TaskStatus.RUNNING.value]
    chosen = running or current
    if not chosen:
        return UNKNOWN
    return merge([task_capabilities(t) for t in chosen])


def group_capabilities(s: Session, group_ids: Iterable[str]) -> dict[str, Capabilities]:
    """Group id -> its capabilities, for the groups named (unknown for one without tasks)."""
    ids = set(group_ids)
    by_group: dict[str, list[Task]] = defaultdict(list)
    if ids:
        for t in s.scalars(
            select(Task).where(Task.group_id.in_(ids), Task.replaced_by == "").order_by(Task.rank)
        ):
            by_group[t.group_id].append(t)
    return {gid: of_tasks(by_group.get(gid, ())) for gid in ids}
