"""A placed stage's place in its gang (G1), read from the gang's rows at its claim.

The scheduler writes a gang whole (``scheduling._flush``): once one stage is scheduled,
every stage of its generation has a node and booked ports, so the claim of any stage
reads rank 0's node address and rendezvous port and hands them to the stage's agent
(``TaskAssignment.gang``), which launches with them (``core.gang.gang_env`` through the
recipe). The dry run computes the same from its placement (``dry_run.planned_gang``) with
the same pure function, ``core.gang.gang_places``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from heteroflow.core.gang import GangPlace, Stage, gang_places
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Node, Task

# A stage that holds its placement: scheduled on a node, starting, running, or asleep.
_PLACED = tuple(
    st.value for st in (
        TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.SLEEPING,
        TaskStatus.WAKING,
    )
)


def gang_place(s: Session, t: Task) -> GangPlace | None:
    """``t``'s place among the placed stages of its group's generation; None when the
    gang is not whole on nodes (a stage replaced meanwhile: the claim launches nothing
    it could not connect, and the stage fails at its rendezvous instead of hanging on
    a wrong address — see the report's open points)."""
    return gang_places_of(s, {(t.group_id, t.generation)}).get(t.id)


def gang_places_of(
    db: Session | Connection, gangs: Iterable[tuple[str, int]]
) -> dict[str, GangPlace]:
    """The place of every placed stage of the gangs named (group id, generation), by task
    id, in one read: a claim's one stage, or every pipeline stage a batch of heartbeats
    lists (a wake relaunches a stage from it). A gang not whole on nodes has none."""
    keys = set(gangs)
    if not keys:
        return {}
    rows = db.execute(
        select(Task.id, Task.group_id, Task.generation, Task.rank, Task.ports, Node.address)
        .join(Node, Node.id == Task.node_id)
        .where(
            Task.group_id.in_(sorted({g for g, _ in keys})),
            Task.status.in_(_PLACED),
        )
        .order_by(Task.rank)
    ).all()
    by_gang: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for r in rows:
        key = (str(r.group_id), int(r.generation))
        if key in keys:
            by_gang[key].append(r)
    out: dict[str, GangPlace] = {}
    for members in by_gang.values():
        stages = [Stage(int(r.rank), str(r.address), ports_from_dicts(r.ports)) for r in members]
        try:
            places = gang_places(stages)
        except ValueError:
            continue
        out.update((str(r.id), p) for p, r in zip(places, members, strict=True))
    return out
