"""GPU time segments (N4): written by the one door for state changes, read by the report.

**The writer.** ``transition`` and ``transition_many`` (``services/lifecycle/transitions.py``) call
``record`` when tasks move between metered buckets (``core.metering.metered_state``):
the open segment of each is closed at ``now`` and, when the new state is metered, a new
one opened with the commitment ``core.quotas.task_usage`` gives (the rule quotas count
by), the task's tenant, owner (``tasks.created_by``), group and node after the move. A
batch is at most three statements per 1,000 tasks: one UPDATE closing (none from
pending, the scheduler's move: nothing is open there), one SELECT of the moved tasks'
columns, one executemany INSERT. It runs in the transition's unit of work, after the
task's compare-and-set won, so the task's row lock orders two changes of one task and
a task has at most one open segment.

Every change of ``tasks.status`` passes that door (tasks are never deleted: a deleted
service's tasks are stopped through it, and the segments close when they stop), so an
open segment belongs to a task in a metered state, and every task in one has an open
segment (migration 0014 opened one for each task that already held cards).

**The reader.** ``sums`` clips the segments overlapping ``[lo, hi)`` (an open one runs
to ``hi``, which the report caps at now) and adds them up by any of tenant, member (the
task's owner), service (group), model (the group's ``model_name``) and UTC hour or day.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import ColumnElement, Table, insert, or_, select, update
from sqlalchemy.orm import Session

from heteroflow.core.metering import Meter, Unit, pieces
from heteroflow.core.quotas import task_usage
from heteroflow.db.tables import GpuTimeSegment, Task, TaskGroup

_CHUNK = 1000  # ids per IN (...) list
_SEGMENTS = cast(Table, GpuTimeSegment.__table__)
_TASKS = cast(Table, Task.__table__)

# the dimensions GPU time has (it has no endpoint)
DIMENSIONS = frozenset({"tenant", "member", "service", "model", "hour", "day"})


def record(
    s: Session, now: datetime, task_ids: Collection[str], src: str | None, to: str | None
) -> None:
    """``task_ids`` just moved from the metered bucket ``src`` to ``to`` (None: none):
    close their open segments at ``now`` and, when ``to`` is metered, open one each.
    (Core statements on the tables: the scheduler's batches pass here.)"""
    ids = sorted(task_ids)
    if src is not None:  # from pending nothing is open: every change passes the door
        for i in range(0, len(ids), _CHUNK):
            s.execute(
                update(_SEGMENTS)
                .where(
                    _SEGMENTS.c.task_id.in_(ids[i : i + _CHUNK]),
                    _SEGMENTS.c.ended_at.is_(None),
                )
                .values(ended_at=now)
            )
    if to is None:
        return
    rows: list[dict[str, Any]] = []
    t = _TASKS.c
    for i in range(0, len(ids), _CHUNK):
        q = select(
            t.id, t.group_id, t.tenant_id, t.created_by, t.node_id,
            t.gpu_required, t.task_type, t.gpu_memory_utilization, t.memory_mb,
        ).where(t.id.in_(ids[i : i + _CHUNK]))
        for tid, gid, tenant, owner, node, gpus, kind, util, mem in s.execute(q):
            usage = task_usage(
                gpu_required=gpus, task_type=kind, gpu_memory_utilization=util, memory_mb=mem
            )
            rows.append(
                {
                    "task_id": tid, "group_id": gid, "tenant_id": tenant, "user_id": owner,
                    "node_id": node or "", "state": to, "card_pct": usage.card_pct,
                    "started_at": now, "ended_at": None,
                }
            )
    if rows:
        s.execute(insert(_SEGMENTS), rows)


Key = tuple[Any, ...]


def sums(
    s: Session,
    *,
    lo: datetime | None,
    hi: datetime,
    group_by: Sequence[str],
    tenant_id: str | None = None,
    member_id: str | None = None,
    service_id: str | None = None,
    model: str | None = None,
) -> dict[Key, Meter]:
    """GPU time in ``[lo, hi)`` per key: the values of ``group_by`` (each one of
    ``DIMENSIONS``) in its order; hour keys are the bucket's UTC start, day keys its
    date. Segments still open run to ``hi``."""
    unknown = set(group_by) - DIMENSIONS
    if unknown:
        raise ValueError(f"GPU time has no {sorted(unknown)}")
    need_model = "model" in group_by or model is not None
    seg = GpuTimeSegment
    cols: list[Any] = [
        seg.tenant_id, seg.user_id, seg.group_id, seg.state, seg.card_pct,
        seg.started_at, seg.ended_at,
    ]
    where: list[ColumnElement[bool]] = [seg.started_at < hi]
    if lo is not None:
        where.append(or_(seg.ended_at.is_(None), seg.ended_at > lo))
    for column, value in (
        (seg.tenant_id, tenant_id), (seg.user_id, member_id), (seg.group_id, service_id),
    ):
        if value is not None:
            where.append(column == value)
    q = select(*cols)
    if need_model:
        q = q.add_columns(TaskGroup.model_name).outerjoin(
            TaskGroup, TaskGroup.id == seg.group_id
        )
        if model is not None:
            where.append(TaskGroup.model_name == model)
    unit: Unit | None = "hour" if "hour" in group_by else "day" if "day" in group_by else None
    out: dict[Key, Meter] = defaultdict(Meter)
    for row in s.execute(q.where(*where)):
        tenant, owner, group, state, pct, started, ended = row[:7]
        fixed = {
            "tenant": tenant, "member": owner, "service": group,
            "model": row[7] if need_model else None,
        }
        for bucket, us in pieces(started, ended, lo=lo, hi=hi, unit=unit):
            out[tuple(_value(g, bucket, fixed) for g in group_by)].add(state, pct, us)
    return dict(out)


def _value(dimension: str, bucket: datetime | None, fixed: dict[str, Any]) -> Any:
    if dimension == "hour":
        return bucket
    if dimension == "day":
        return None if bucket is None else bucket.date()
    return fixed[dimension]
