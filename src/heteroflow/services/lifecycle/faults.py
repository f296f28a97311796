"""Group-level fault events (E2): what went wrong, on the group's one timeline.

A fault is a fact beside the state changes ``transitions`` records: an ``events`` row
with ``kind = fault.<what>`` (``core.events.EventKind``), the group it concerns,
``task_id`` when it concerns exactly one task of that group (otherwise None and the
message names the tasks), ``node_id`` of the node it happened on, and a readable message
with the details (node name, card index, exit code …). The message is for people: no
code reads it back. The group's timeline is ``GET /api/v1/task-groups/{id}/events``,
oldest first.

Who writes which kind:

- ``fault.container_lost`` / ``fault.engine_exited`` / ``fault.unhealthy`` /
  ``fault.load_stalled`` (D5: a load that made no progress): a ``failed`` report from
  the agent that names the fault (``services.nodes.report``), in the same transaction as
  the task's transition and just before it (cause, then effect).
- ``fault.gpu_lost``: a heartbeat whose inventory no longer lists a card that a task
  holding resources is placed on (``services.nodes.heartbeat``).
- ``fault.node_lost`` / ``fault.node_back``: ``watch_nodes`` (the ``NodeWatch`` loop).

How ``watch_nodes`` remembers a loss: next to the group rows it writes one node-level
row of the same kind with ``group_id`` NULL, ``task_id`` NULL, ``node_id`` = the node,
and ``from_status``/``to_status`` = the node's ``online``/``offline`` change. The latest
such row of a node (by ``node_id`` and ``kind``, never by message) is its recorded
state: ``fault.node_lost`` means "lost, not back yet". Every round compares the recorded
state with the heartbeat-derived one (level-triggered): running a round twice writes
nothing new. When a node returns, ``fault.node_back`` goes to exactly the groups that
got a ``fault.node_lost`` with its ``node_id`` since its node-level loss row. (Rows
written before migration 0009 got their ``node_id`` there, parsed once from the text.)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, load_only

from heteroflow.core.clock import Clock
from heteroflow.core.events import FAULT_EVENT, NODE_MARKS, EventKind, FaultKind
from heteroflow.core.states import AGENT_OWNED, HOLDS_RESOURCES
from heteroflow.db.tables import Event, Node, Task

log = logging.getLogger(__name__)

ONLINE, OFFLINE = "online", "offline"  # a node's from/to on node_lost / node_back rows


def record(
    s: Session,
    clock: Clock,
    *,
    group_id: str | None,
    kind: EventKind,
    message: str,
    node_id: str | None,
    task_id: str | None = None,
    from_status: str = "",
    to_status: str = "",
) -> None:
    """Add one fault row to the caller's unit of work."""
    s.add(
        Event(
            group_id=group_id,
            task_id=task_id,
            node_id=node_id,
            kind=kind.value,
            from_status=from_status,
            to_status=to_status,
            message=message,
            created_at=clock.now(),
        )
    )


def _label(t: Task) -> str:
    return f"{t.name} ({t.id}, {t.status})"


def _per_group(tasks: Iterable[Task]) -> dict[str, list[Task]]:
    groups: dict[str, list[Task]] = defaultdict(list)
    for t in sorted(tasks, key=lambda t: (t.group_id, t.name, t.id)):
        groups[t.group_id].append(t)
    return groups


def _only(tasks: list[Task]) -> str | None:
    return tasks[0].id if len(tasks) == 1 else None


def task_fault(
    s: Session, clock: Clock, t: Task, node_name: str, fault: FaultKind, detail: str
) -> None:
    """An agent-reported fault of one task (``TaskReport.fault``), on its node."""
    record(
        s,
        clock,
        group_id=t.group_id,
        task_id=t.id,
        node_id=t.node_id,
        kind=FAULT_EVENT[fault],
        message=f"task {t.name} ({t.id}) on node {node_name}: {detail}",
    )


def gpu_lost(s: Session, clock: Clock, node: Node, cards: list[dict[str, Any]]) -> int:
    """Cards that vanished from ``node``'s inventory: one event per group placed on each.

    Returns how many events were written. Called with the node's previous inventory
    entries of the vanished cards, before the new inventory replaces them.
    """
    statuses = [x.value for x in HOLDS_RESOURCES]
    holding = list(
        s.scalars(select(Task).where(Task.node_id == node.id, Task.status.in_(statuses)))
    )
    written = 0
    for card in cards:
        index = int(card["index"])
        what = ", ".join(str(card[k]) for k in ("model", "uuid") if card.get(k))
        name = f"GPU {index}" + (f" ({what})" if what else "")
        on_card = [t for t in holding if index in t.gpu_ids]
        log.warning(
            "node %s: %s vanished from the inventory; %d task(s) placed on it",
            node.name,
            name,
            len(on_card),
        )
        for group_id, tasks in _per_group(on_card).items():
            record(
                s,
                clock,
                group_id=group_id,
                task_id=_only(tasks),
                node_id=node.id,
                kind=EventKind.GPU_LOST,
                message=f"{name} vanished from node {node.name}'s inventory; placed on it: "
                + ", ".join(_label(t) for t in tasks),
            )
            written += 1
    return written


@dataclass
class WatchResult:
    """Node names whose loss / return this round recorded."""

    lost: list[str] = field(default_factory=list)
    back: list[str] = field(default_factory=list)


def latest_marks(s: Session, node_ids: list[str] | None = None) -> dict[str, Event]:
    """Node id -> its latest node-level node_lost / node_back row (of ``node_ids`` only,
    when given)."""
    node_level = (Event.group_id.is_(None), Event.kind.in_([k.value for k in NODE_MARKS]))
    which = Event.node_id.is_not(None) if node_ids is None else Event.node_id.in_(node_ids)
    latest = select(func.max(Event.id)).where(*node_level, which).group_by(Event.node_id)
    rows = s.scalars(select(Event).where(Event.id.in_(latest)))
    return {str(e.node_id): e for e in rows}


def watch_nodes(s: Session, clock: Clock, offline_after_s: float) -> WatchResult:
    """One level-triggered round: record nodes lost with live tasks, and their return."""
    now = clock.now()
    cutoff = now - timedelta(seconds=offline_after_s)
    marks = latest_marks(s)
    result = WatchResult()
    newly_offline: list[Node] = []
    # Only the nodes whose state may change this round: those past the cutoff, and those
    # marked lost (they may be back). A fleet that heartbeats costs one filtered scan in
    # the database, not a Python object per node each second: loading every node held
    # one server under 2,000 agents (bench/control_plane.py). Only the columns the watch
    # reads; the rest loads on use, for a node that changed state.
    lost_ids = [nid for nid, m in marks.items() if m.kind == EventKind.NODE_LOST]
    maybe = Node.last_heartbeat_at < cutoff
    if lost_ids:
        maybe = or_(maybe, Node.id.in_(lost_ids))
    rows = select(Node).where(maybe).options(
        load_only(Node.id, Node.name, Node.last_heartbeat_at)
    )
    for node in s.scalars(rows.order_by(Node.name)):
        mark = marks.get(node.id)
        is_lost = mark is not None and mark.kind == EventKind.NODE_LOST
        if node.last_heartbeat_at < cutoff:
            if not is_lost:
                newly_offline.append(node)
        elif mark is not None and is_lost:
            _node_back(s, clock, node, mark)
            result.back.append(node.name)
    live = _live_tasks(s, [n.id for n in newly_offline])
    for node in newly_offline:
        if live.get(node.id):  # an idle node going away is no group's fault
            _node_lost(s, clock, node, live[node.id], now)
            result.lost.append(node.name)
    return result


def _live_tasks(s: Session, node_ids: list[str]) -> dict[str, list[Task]]:
    """Node id -> its starting/running tasks (only the nodes asked about)."""
    live: dict[str, list[Task]] = defaultdict(list)
    if node_ids:
        statuses = [x.value for x in AGENT_OWNED]
        for t in s.scalars(
            select(Task).where(Task.node_id.in_(node_ids), Task.status.in_(statuses))
        ):
            live[str(t.node_id)].append(t)
    return live


def _node_lost(s: Session, clock: Clock, node: Node, tasks: list[Task], now: datetime) -> None:
    away = (now - node.last_heartbeat_at).total_seconds()
    head = f"node {node.name} lost: no heartbeat for {away:.0f} s"
    groups = _per_group(tasks)
    log.warning("%s; %d task(s) of %d group(s) affected", head, len(tasks), len(groups))
    lost = EventKind.NODE_LOST
    record(
        s,
        clock,
        group_id=None,
        node_id=node.id,
        kind=lost,
        from_status=ONLINE,
        to_status=OFFLINE,
        message=f"{head} (node id {node.id}); {len(tasks)} task(s) of "
        f"{len(groups)} group(s) affected",
    )
    for group_id, mine in groups.items():
        record(
            s,
            clock,
            group_id=group_id,
            task_id=_only(mine),
            node_id=node.id,
            kind=lost,
            from_status=ONLINE,
            to_status=OFFLINE,
            message=f"{head}; unreachable: " + ", ".join(_label(t) for t in mine),
        )


def _node_back(s: Session, clock: Clock, node: Node, mark: Event) -> None:
    """Tell every group told of this loss (its rows follow the node-level one)."""
    told = s.scalars(
        select(Event)
        .where(
            Event.node_id == node.id,
            Event.id > mark.id,
            Event.kind == EventKind.NODE_LOST.value,
            Event.group_id.is_not(None),
        )
        .order_by(Event.id)
    )
    mine = {e.group_id: e for e in told}
    since = mark.created_at.isoformat()
    head = f"node {node.name} back: heartbeating again (reported lost at {since})"
    log.info("%s; %d group(s) told", head, len(mine))
    back = EventKind.NODE_BACK
    record(
        s, clock, group_id=None, node_id=node.id, kind=back, from_status=OFFLINE,
        to_status=ONLINE, message=f"{head} (node id {node.id})",
    )
    for group_id, lost in mine.items():
        record(
            s, clock, group_id=group_id, task_id=lost.task_id, node_id=node.id, kind=back,
            from_status=OFFLINE, to_status=ONLINE, message=head,
        )
