"""One scheduler round: claim queued tasks, place them with the pure pipeline, commit.

Queue (B4): pending tasks by priority (higher first), then age (FIFO), then rank. On
PostgreSQL a round claims its tasks with ``FOR UPDATE SKIP LOCKED``, so several
scheduler workers — threads of one server or several servers on one database — take
disjoint tasks. Cards are guarded by ``nodes.booking_version``: the round reads it with
the fleet, and its commit bumps it with a compare-and-set; a node that another
scheduler booked in between fails the check, its decisions are dropped and those tasks
stay queued for the next round. Commits are serialised per database by a transaction-
scoped advisory lock (PostgreSQL), which also rules out lock-order deadlocks.

Decisions are written in batches (``commit_batch``): one executemany per table instead
of one round trip per task; each task still moves through the state door's rules
(pending → scheduled only when it is still pending) and gets its event.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, func, select, text, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import needs_container
from heteroflow.core.engines.registry import vendors_of
from heteroflow.core.engines.selection import EngineChoice
from heteroflow.core.events import EventKind
from heteroflow.core.placement import (
    NodeView,
    Placement,
    Policy,
    Reservation,
    TaskDemand,
)
from heteroflow.core.placement.preemption import Preemption
from heteroflow.core.ports import PortMapping, host_ports, ports_from_dicts, with_host_ports
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, Node, Task, TaskGroup
from heteroflow.services.lifecycle.transitions import (
    Move,
    TaskUpdate,
    set_pending_reasons,
    transition,
    transition_many,
)
from heteroflow.services.placement.fleet import read_fleet
from heteroflow.services.placement.placer import Intent, Outcome, Placer

log = logging.getLogger(__name__)
_PG_LOCK_KEY = 0x4846_5343  # "HFSC": the scheduler's commit lock


@dataclass(slots=True)
class RoundResult:
    placed: int
    unplaced: int
    preempted: int = 0
    conflicts: int = 0  # decisions dropped: another scheduler booked the node first
    decision_ms: list[float] = field(default_factory=list)  # per placed task, commit included


@dataclass(slots=True)
class _Decision:
    row: Row[Any]
    demand: TaskDemand
    placement: Placement
    node: NodeView
    choice: EngineChoice | None
    compute_s: float


def node_views(
    s: Session, clock: Clock, offline_after_s: float, keys: dict[str, str] | None = None
) -> dict[str, NodeView]:
    """The views of ``read_fleet`` (the one read model of the fleet), by node id."""
    return read_fleet(s, clock, offline_after_s, keys).views


def _demand(t: Row[Any], keys: dict[str, str]) -> TaskDemand:
    return TaskDemand(
        task_id=t.id,
        gpu_required=t.gpu_required,
        gpu_type=t.gpu_type,
        gpu_memory_utilization=t.gpu_memory_utilization,
        estimated_gpu_memory_mb=t.estimated_gpu_memory_mb,
        memory_mb=t.memory_mb,
        host_ports=host_ports(ports_from_dicts(t.ports)),
        task_type=t.task_type,
        model_path=t.model_path,
        engine=t.engine,
        share_key=keys.get(t.tenant_id, t.tenant_id),
        tenant_id=t.tenant_id,
        priority=t.priority,
        group_id=t.group_id,
        multi_node=t.parallelism == "pipeline",
        engine_vendors=vendors_of(t.engine),
        priority_class=t.priority_class,
        needs_container=needs_container(t.command, t.engine),
        host_paths=tuple(str(v["host_path"]) for v in t.volumes or ()),  # A2
        preemptible=t.preemptible,
    )


class _Round:
    """The state of one round: the placer (views, index, caches) and what to write."""

    def __init__(
        self,
        s: Session,
        clock: Clock,
        offline_after_s: float,
        reservation: Reservation,
        port_pool: range,
        policy: Policy,
    ) -> None:
        self.s, self.clock = s, clock
        fleet = read_fleet(s, clock, offline_after_s)
        self.keys = fleet.keys
        self.views = fleet.views
        self.placer = Placer(fleet, reservation, port_pool, policy)
        self.decisions: list[_Decision] = []
        self.reasons: dict[str, str] = {}  # task id -> new pending reason
        self.preemptions: list[tuple[Row[Any], Preemption]] = []
        self.result = RoundResult(0, 0)
        self.waiting_for = _outstanding_preemptions(s)

    def unplaced(self, t: Row[Any], reason: str) -> None:
        self.result.unplaced += 1
        if t.status_message != reason:
            self.reasons[t.id] = reason

    def decide(self, t: Row[Any]) -> None:
        start = time.perf_counter()
        d = _demand(t, self.keys)
        o = self.placer.decide(d, _intent(t), self.waiting_for.get(t.id, 0))
        self._record(t, d, o, time.perf_counter() - start)

    def decide_gang(self, members: list[Row[Any]]) -> None:
        """G1: a pipeline group's queued stages are placed together or not at all."""
        start = time.perf_counter()
        demands = [_demand(t, self.keys) for t in members]
        outcomes = self.placer.decide_gang(demands)
        dt = (time.perf_counter() - start) / len(members)
        for t, d, o in zip(members, demands, outcomes, strict=True):
            self._record(t, d, o, dt)

    def _record(self, t: Row[Any], d: TaskDemand, o: Outcome, dt: float) -> None:
        if o.placement is not None and o.node is not None:
            self.decisions.append(_Decision(t, d, o.placement, o.node, o.choice, dt))
            return
        if o.preemption is not None:
            self.preemptions.append((t, o.preemption))
        self.unplaced(t, o.reason)


def _intent(t: Row[Any]) -> Intent:
    return Intent(image=t.image, named=bool(t.engine or t.command))


def _outstanding_preemptions(s: Session) -> dict[str, int]:
    q = (
        select(Task.preempted_by, func.count())
        .where(Task.preempted_by != "", Task.status == TaskStatus.STOPPING.value)
        .group_by(Task.preempted_by)
    )
    return {pid: int(n) for pid, n in s.execute(q)}


def _queue(s: Session, limit: int) -> list[Row[Any]]:
    q = (
        select(
            Task.id, Task.group_id, Task.tenant_id, Task.gpu_required, Task.gpu_type,
            Task.gpu_memory_utilization, Task.estimated_gpu_memory_mb, Task.memory_mb,
            Task.ports, Task.task_type, Task.model_path, Task.engine, Task.command,
            Task.image, Task.priority, Task.status_message, Task.generation, Task.engine_reason,
            Task.priority_class, Task.volumes, Task.preemptible, TaskGroup.parallelism,
        )
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(Task.status == TaskStatus.PENDING.value)
        .order_by(Task.priority.desc(), Task.created_at, Task.rank)
        .limit(limit)
    )
    if s.get_bind().dialect.name == "postgresql":
        q = q.with_for_update(of=Task, skip_locked=True)
    return list(s.execute(q))


def schedule_round(
    s: Session,
    clock: Clock,
    *,
    offline_after_s: float,
    reservation: Reservation,
    port_pool: range,
    policy: Policy | None = None,
    limit: int = 10_000,
    commit_batch: int = 500,
) -> RoundResult:
    pending = _queue(s, limit)
    if not pending:
        return RoundResult(0, 0)
    rnd = _Round(s, clock, offline_after_s, reservation, port_pool, policy or Policy())
    gangs: dict[tuple[str, int], list[Row[Any]]] = defaultdict(list)
    for t in pending:
        if t.parallelism == "pipeline":
            gangs[(t.group_id, t.generation)].append(t)
    done_gangs: set[tuple[str, int]] = set()
    for t in pending:
        key = (t.group_id, t.generation)
        if t.parallelism == "pipeline":
            if key not in done_gangs:
                done_gangs.add(key)
                rnd.decide_gang(gangs[key])
        else:
            rnd.decide(t)
        if len(rnd.decisions) >= commit_batch:
            _flush(rnd)
    _flush(rnd)
    _write_preemptions(rnd)
    _write_reasons(rnd)
    return rnd.result


def _lock_commits(s: Session) -> None:
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})


def _cas_nodes(s: Session, expected: dict[str, int]) -> set[str]:
    """Bump booking_version on the nodes; the ids whose version was still as read."""
    _lock_commits(s)
    ok: set[str] = set()
    ids = sorted(expected)
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        rows = s.execute(
            update(Node)
            .where(Node.id.in_(chunk))
            .values(booking_version=Node.booking_version + 1)
            .returning(Node.id, Node.booking_version)
            .execution_options(synchronize_session=False)
        )
        ok.update(nid for nid, v in rows if v == expected[nid] + 1)
    return ok


def _flush(rnd: _Round) -> None:
    if not rnd.decisions:
        return
    start = time.perf_counter()
    s = rnd.s
    decisions, rnd.decisions = rnd.decisions, []
    touched = {d.node.id: d.node for d in decisions}
    ok_nodes = _cas_nodes(s, {nid: n.version for nid, n in touched.items()})
    for n in touched.values():
        n.version += 1  # bumped in the database either way (ours or another's)
    # a gang is written whole or not at all
    bad_groups = {
        d.row.group_id for d in decisions
        if d.node.id not in ok_nodes and d.row.parallelism == "pipeline"
    }
    keep = [
        d for d in decisions if d.node.id in ok_nodes and d.row.group_id not in bad_groups
    ]
    rnd.result.conflicts += len(decisions) - len(keep)
    if keep:
        # PostgreSQL: the queue rows are ours (FOR UPDATE SKIP LOCKED) until the commit
        moved = transition_many(
            s,
            rnd.clock,
            TaskStatus.PENDING,
            TaskStatus.SCHEDULED,
            [Move(d.row.id, d.row.group_id, _placed_message(d), _task_values(d)) for d in keep],
            rows_locked=s.get_bind().dialect.name == "postgresql",
            group_message="placed",
        )
        written = [d for d in keep if d.row.id in moved]
        rnd.result.conflicts += len(keep) - len(written)
        per = (time.perf_counter() - start) / max(1, len(decisions))
        rnd.result.placed += len(written)
        rnd.result.decision_ms.extend((d.compute_s + per) * 1000 for d in written)
        for d in written:
            rnd.reasons.pop(d.row.id, None)


def _placed_message(d: _Decision) -> str:
    p = d.placement
    where = f"placed on {d.node.name}" + (f" cards {list(p.gpu_ids)}" if p.gpu_ids else " (CPU)")
    if p.borrowed:
        where += " (borrowing the cards of a sleeping inference service)"
    return where + (f", QoS {p.qos}" if p.gpu_ids else "")


def _task_values(d: _Decision) -> TaskUpdate:
    t, p = d.row, d.placement
    ports = with_host_ports(ports_from_dicts(t.ports), p.host_ports)
    engine, reason = t.engine, t.engine_reason
    if d.choice is not None:
        engine = d.choice.engine
        reason = f"on {d.node.name}: {d.choice.reason}"
    return TaskUpdate(
        node_id=p.node_id,
        gpu_ids=tuple(p.gpu_ids),
        ports=ports,
        memory_mb=p.memory_mb if t.gpu_required == 0 else t.memory_mb,
        qos=p.qos,
        engine=engine,
        engine_reason=reason,
    )


def _write_preemptions(rnd: _Round) -> None:
    """B4: victims leave their cards through the state door; an event on both sides."""
    s, clock = rnd.s, rnd.clock
    for t, plan in rnd.preemptions:
        node = rnd.views[plan.node_id]
        moved: list[str] = []
        for v in plan.victims:
            why = f"preempted by {t.group_id} (task {t.id}, priority {t.priority})"
            status = s.scalar(select(Task.status).where(Task.id == v.task_id))
            if status == TaskStatus.SCHEDULED.value:
                ok = transition(
                    s, clock, v.task_id, TaskStatus.SCHEDULED, TaskStatus.PENDING, why,
                    update=TaskUpdate(
                        node_id=None, gpu_ids=(), qos="", ports=_pool_ports(s, v.task_id)
                    ),
                )
            elif status in (TaskStatus.STARTING.value, TaskStatus.RUNNING.value):
                ok = transition(
                    s, clock, v.task_id, TaskStatus(status), TaskStatus.STOPPING, why,
                    update=TaskUpdate(preempted_by=t.id),
                )
            else:
                ok = False
            if ok:
                moved.append(v.task_id)
        if moved:
            _cas_nodes(s, {node.id: node.version})  # others must re-read this node
            node.version += 1
            rnd.result.preempted += len(moved)
            s.add(
                Event(
                    group_id=t.group_id, task_id=t.id, kind=EventKind.PREEMPTION.value,
                    message=f"preempting {', '.join(moved)} on {node.name} "
                    f"(priority {t.priority} over lower-priority work)",
                    created_at=clock.now(),
                )
            )


def _pool_ports(s: Session, task_id: str) -> tuple[PortMapping, ...]:
    ports = s.scalar(select(Task.ports).where(Task.id == task_id)) or []
    return tuple(m.released() for m in ports_from_dicts(ports))


def _write_reasons(rnd: _Round) -> None:
    set_pending_reasons(rnd.s, rnd.reasons)
