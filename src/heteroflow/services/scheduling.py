"""One scheduler round: read the queue and the fleet, place with the pure policy, CAS."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.engines.selection import (
    EngineChoice,
    NodeEngines,
    NoEngineAvailable,
    select_engine,
)
from heteroflow.core.placement import (
    CardView,
    NodeView,
    Placement,
    Policy,
    Reservation,
    TaskDemand,
    commit,
    place,
)
from heteroflow.core.states import HOLDS_RESOURCES, TaskStatus
from heteroflow.db.tables import Node, Task
from heteroflow.services.nodes import node_engines
from heteroflow.services.transitions import set_pending_reason, transition

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoundResult:
    placed: int
    unplaced: int


def node_views(s: Session, clock: Clock, offline_after_s: float) -> dict[str, NodeView]:
    cutoff = clock.now() - timedelta(seconds=offline_after_s)
    views = {
        n.id: NodeView(
            id=n.id,
            name=n.name,
            online=n.last_heartbeat_at >= cutoff,
            cards=[
                CardView(
                    index=int(g["index"]),
                    vendor=str(g.get("vendor", "")),
                    model=str(g.get("model", "")),
                    memory_total_mb=int(g["memory_total_mb"]),
                    memory_used_mb=int(g.get("memory_used_mb", 0)),
                )
                for g in n.gpus
            ],
            cpu_count=n.cpu_count,
            memory_total_mb=n.memory_total_mb,
            cpu_percent=n.cpu_percent,
            memory_percent=n.memory_percent,
            models=frozenset(
                str(m.get(k, "")) for m in n.models for k in ("path", "name") if m.get(k)
            ),
            engines=frozenset(str(e) for e in n.engines),
        )
        for n in s.scalars(select(Node).order_by(Node.name))
    }
    held = select(Task).where(
        Task.status.in_([st.value for st in HOLDS_RESOURCES]), Task.node_id.is_not(None)
    )
    for t in s.scalars(held):
        view = views.get(t.node_id or "")
        if view is None:
            continue
        for c in view.cards:
            if c.index in t.gpu_ids:
                c.committed_mb += t.estimated_gpu_memory_mb
                c.committed_pct += t.gpu_memory_utilization
        if t.gpu_required == 0:
            view.memory_committed_mb += t.memory_mb
        view.inference_tasks += int(t.task_type == "inference")
        view.ports_in_use.update(int(p["host_port"]) for p in t.ports if p.get("host_port"))
    return views


def _demand(t: Task) -> TaskDemand:
    return TaskDemand(
        task_id=t.id,
        gpu_required=t.gpu_required,
        gpu_type=t.gpu_type,
        gpu_memory_utilization=t.gpu_memory_utilization,
        estimated_gpu_memory_mb=t.estimated_gpu_memory_mb,
        memory_mb=t.memory_mb,
        host_ports=tuple(int(p.get("host_port", 0)) for p in t.ports),
        inference=t.task_type == "inference",
        model_path=t.model_path,
        engine=t.engine,
    )


def _engine_candidates(
    t: Task, nodes: list[NodeView], engines: dict[str, NodeEngines]
) -> tuple[list[NodeView], dict[str, EngineChoice], str]:
    """For a task that names no engine: the nodes whose chain yields one (H1), and why not."""
    ok: list[NodeView] = []
    choices: dict[str, EngineChoice] = {}
    why: list[str] = []
    for n in nodes:
        try:
            choice = select_engine(explicit="", label="", image=t.image, node=engines[n.id])
        except NoEngineAvailable as exc:
            why.append(f"{n.name}: {exc}")
            continue
        ok.append(n)
        choices[n.id] = choice
    reason = "" if ok else "NoEngineAvailable: " + " | ".join(why or ["no node registered"])
    return ok, choices, reason


def _apply(
    s: Session,
    clock: Clock,
    t: Task,
    p: Placement,
    node_name: str,
    choice: EngineChoice | None = None,
) -> bool:
    extra: dict[str, object] = {}
    if choice is not None:
        extra = {"engine": choice.engine, "engine_reason": f"on {node_name}: {choice.reason}"}
    ports = [
        {"container_port": int(m["container_port"]), "host_port": hp}
        for m, hp in zip(t.ports, p.host_ports, strict=True)
    ]
    return transition(
        s,
        clock,
        t.id,
        TaskStatus.PENDING,
        TaskStatus.SCHEDULED,
        f"placed on {node_name}" + (f" cards {list(p.gpu_ids)}" if p.gpu_ids else " (CPU)"),
        node_id=p.node_id,
        gpu_ids=list(p.gpu_ids),
        ports=ports,
        memory_mb=p.memory_mb if t.gpu_required == 0 else t.memory_mb,
        **extra,
    )


def schedule_round(
    s: Session,
    clock: Clock,
    *,
    offline_after_s: float,
    reservation: Reservation,
    port_pool: range,
    policy: Policy | None = None,
    limit: int = 500,
) -> RoundResult:
    pending = list(
        s.scalars(
            select(Task)
            .where(Task.status == TaskStatus.PENDING.value)
            .order_by(Task.priority.desc(), Task.created_at, Task.rank)
            .limit(limit)
        )
    )
    if not pending:
        return RoundResult(0, 0)
    views = node_views(s, clock, offline_after_s)
    nodes = list(views.values())
    engines = {n.id: node_engines(n) for n in s.scalars(select(Node))}
    placed = unplaced = 0
    for t in pending:
        candidates: list[NodeView] = nodes
        choices: dict[str, EngineChoice] = {}
        if not t.engine and not t.command:
            candidates, choices, why = _engine_candidates(t, nodes, engines)
            if not candidates:
                unplaced += 1
                if t.status_message != why:
                    set_pending_reason(s, clock, t.id, why)
                continue
        decision = place(_demand(t), candidates, reservation, port_pool, policy or Policy())
        if isinstance(decision, Placement):
            choice = choices.get(decision.node_id)
            if _apply(s, clock, t, decision, views[decision.node_id].name, choice):
                commit(views[decision.node_id], decision, inference=t.task_type == "inference")
                placed += 1
        else:
            unplaced += 1
            if t.status_message != decision.reason:
                set_pending_reason(s, clock, t.id, decision.reason)
    return RoundResult(placed, unplaced)
