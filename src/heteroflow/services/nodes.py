"""Nodes and the agent protocol: heartbeat (register + desired tasks), claim, report.

Faults seen here become group-level fault events (E2, ``services.faults``): a card that
vanished from a heartbeat's inventory (``fault.gpu_lost``) and a failed report that
names its fault (``fault.container_lost`` / ``engine_exited`` / ``unhealthy``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.engines.selection import NodeEngines
from heteroflow.core.engines.templates import inference_templates as templates_for
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.events import EventKind
from heteroflow.core.ids import new_id
from heteroflow.core.placement.model import may_use
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, Node, Task, TaskGroup
from heteroflow.schemas.nodes import (
    GpuCardWire,
    Heartbeat,
    HeartbeatReply,
    NodeRead,
    TaskAssignment,
    TaskReport,
    TemplateRead,
)
from heteroflow.services import faults
from heteroflow.services.access import task_on_node
from heteroflow.services.transitions import KEEP, TaskUpdate, note, transition

# What an agent is told about: tasks placed on it that it should be starting or running,
# and the ones asleep there (their engines stay stopped, their containers kept) or waking.
DESIRED = (
    TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.SLEEPING,
    TaskStatus.WAKING,
)


def heartbeat(s: Session, clock: Clock, hb: Heartbeat) -> HeartbeatReply:
    now = clock.now()
    node = s.scalar(select(Node).where(Node.name == hb.name))
    inv = hb.inventory
    if node is None:
        node = Node(id=new_id("node"), name=hb.name, registered_at=now)
        s.add(node)
    else:
        _check_cards(s, clock, node, {g.index for g in inv.gpus})
    node.address = hb.address
    node.runtime = hb.runtime
    node.gpus = [g.model_dump() for g in inv.gpus]
    node.cpu_count = inv.cpu_count
    node.memory_total_mb = inv.memory_total_mb
    node.memory_available_mb = inv.memory_available_mb
    node.cpu_percent = inv.cpu_percent
    node.memory_percent = inv.memory_percent
    node.labels = dict(hb.labels)
    node.models = [m.model_dump() for m in hb.models]
    node.engines = dict(hb.engines)
    # C4 volume rules: create refuses an absolute model_path no node the caller may use allows
    node.allowed_volume_prefixes = list(hb.allowed_volume_prefixes)
    node.denied_volume_prefixes = list(hb.denied_volume_prefixes)
    node.host_ports_in_use = sorted(set(hb.host_ports_in_use))  # the pool skips them (P2)
    node.last_heartbeat_at = now
    s.flush()
    rows = s.execute(
        select(Task, TaskGroup.parallelism)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(Task.node_id == node.id, Task.status.in_([d.value for d in DESIRED]))
        .order_by(Task.created_at)
    )
    return HeartbeatReply(node_id=node.id, tasks=[assignment(t, p) for t, p in rows])


def _check_cards(s: Session, clock: Clock, node: Node, now_listed: set[int]) -> None:
    """Cards of the previous inventory missing from this one are lost (all of them when
    NVML stops answering); tasks placed on them get a ``fault.gpu_lost`` per group."""
    vanished = [g for g in node.gpus if int(g["index"]) not in now_listed]
    if vanished:
        faults.gpu_lost(s, clock, node, vanished)


def assignment(t: Task, parallelism: str) -> TaskAssignment:
    return TaskAssignment(
        id=t.id,
        group_id=t.group_id,
        name=t.name,
        status=t.status,
        task_type=t.task_type,
        model_name=t.model_name,
        model_path=t.model_path,
        image=t.image,
        engine=t.engine,
        command=list(t.command),
        engine_args=list(t.engine_args),
        env=list(t.env),
        ports=list(t.ports),
        gpu_ids=list(t.gpu_ids),
        gpu_required=t.gpu_required,
        memory_mb=t.memory_mb,
        kv_offload_gb=t.kv_offload_gb,
        generation=t.generation,
        gpu_memory_utilization=t.gpu_memory_utilization,
        parallelism=parallelism,
        health_check=dict(t.health_check),
    )


def claim(s: Session, clock: Clock, node_id: str, task_id: str) -> TaskAssignment:
    """scheduled -> starting, by CAS: exactly one agent wins a task."""
    t = task_on_node(s, node_id, task_id)
    if not transition(
        s,
        clock,
        t.id,
        TaskStatus.SCHEDULED,
        TaskStatus.STARTING,
        "claimed by agent",
        update=TaskUpdate(started_at=clock.now()),
    ):
        raise Conflict(f"task {task_id} is {t.status}, not scheduled")
    s.refresh(t)
    group = s.get(TaskGroup, t.group_id)
    return assignment(t, group.parallelism if group else "single")


# Which reported outcome moves a task from which state.
_REPORT_FROM: dict[TaskStatus, tuple[TaskStatus, ...]] = {
    TaskStatus.RUNNING: (TaskStatus.STARTING, TaskStatus.WAKING),
    TaskStatus.FAILED: (
        TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.STOPPING, TaskStatus.SLEEPING,
        TaskStatus.WAKING,
    ),
    TaskStatus.COMPLETED: (TaskStatus.STARTING, TaskStatus.RUNNING),
    TaskStatus.STOPPED: (
        TaskStatus.STOPPING, TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.SLEEPING,
        TaskStatus.WAKING,
    ),
}


def report(s: Session, clock: Clock, node_id: str, task_id: str, rep: TaskReport) -> str:
    """Apply an agent's report; returns the task's status afterwards.

    A report that names a fault writes its ``fault.*`` event in the same transaction,
    only when the task really fails (not for a repeat, nor for a task being stopped).
    """
    t = task_on_node(s, node_id, task_id)
    to = TaskStatus(rep.status)
    current = TaskStatus(t.status)
    if to == TaskStatus.STARTING:  # a note: the launch is being retried, and why
        if current != TaskStatus.STARTING:
            raise Conflict(f"task {task_id} is {current}; cannot note a launch retry")
        note(s, clock, t.id, current, EventKind.LAUNCH_RETRY, rep.message, node_id)
        return current.value
    if to == TaskStatus.PENDING:
        return _ports_taken(s, clock, node_id, t, rep.busy_ports, rep.message)
    if current == TaskStatus.STOPPING and to == TaskStatus.FAILED:
        to = TaskStatus.STOPPED  # it was asked to stop; an exit on the way is still a stop
    if rep.argv is not None:
        t.launch_argv = list(rep.argv)
    if current == to:
        return current.value
    if current not in _REPORT_FROM[to]:
        raise Conflict(f"task {task_id} is {current}; cannot report {to}")
    if current == TaskStatus.STOPPING and to == TaskStatus.STOPPED and t.preempted_by:
        group = s.get(TaskGroup, t.group_id)
        if group is not None and group.deleted_at is None:
            return _requeue_preempted(s, clock, t)
    if rep.fault is not None and to == TaskStatus.FAILED:
        # Before the transition (cause, then effect); a lost race rolls both back.
        node = s.get(Node, node_id)
        faults.task_fault(s, clock, t, node.name if node else node_id, rep.fault, rep.message)
    if not transition(s, clock, t.id, current, to, rep.message):
        raise Conflict(f"task {task_id} changed concurrently; report again")
    return to.value


# How many times one task may find its pool ports taken at launch before it fails.
MAX_PORT_CONFLICTS = 5


def _ports_taken(s: Session, clock: Clock, node_id: str, t: Task, busy: list[int], why: str) -> str:
    """P2: host ports the pool chose were found taken on the node at launch (by another
    program). The node's view of its ports gets them at once, and the task goes back to
    the queue with those ports given back, so the next round places it again with free
    ones — not the same port retried for minutes. A task that keeps meeting taken ports
    fails, saying so."""
    current = TaskStatus(t.status)
    if current != TaskStatus.STARTING:
        raise Conflict(f"task {t.id} is {current}; only a starting task gives back ports")
    ports = ports_from_dicts(t.ports)
    if not any(p.from_pool and p.host_port in busy for p in ports):
        raise Conflict(f"task {t.id}: ports {busy} are not ones the pool chose for it")
    node = s.get(Node, node_id)
    name = node.name if node is not None else node_id
    if node is not None:  # until its next heartbeat says what really listens there
        node.host_ports_in_use = sorted({*node.host_ports_in_use, *busy})
    seen = (
        s.scalar(
            select(func.count())
            .select_from(Event)
            .where(Event.task_id == t.id, Event.kind == EventKind.PORT_CONFLICT.value)
        )
        or 0
    )
    listed = ", ".join(str(p) for p in busy)
    what = f"host port {listed} taken on node {name} at launch ({why or 'in use'})"
    if seen + 1 >= MAX_PORT_CONFLICTS:
        message = f"{what}; ports were taken at {seen + 1} launches in a row, giving up"
        to, update = TaskStatus.FAILED, KEEP
    else:
        message = f"{what}; placing it again with another port (launch {seen + 2})"
        to = TaskStatus.PENDING
        update = TaskUpdate(
            node_id=None,
            gpu_ids=(),
            qos="",
            started_at=None,
            ports=tuple(p.released() if p.host_port in busy else p for p in ports),
        )
        s.add(
            Event(
                group_id=t.group_id,
                task_id=t.id,
                kind=EventKind.PORT_CONFLICT.value,
                message=message,
                created_at=clock.now(),
                node_id=node_id,
            )
        )
    if not transition(s, clock, t.id, current, to, message, update=update):
        raise Conflict(f"task {t.id} changed concurrently; report again")
    return to.value


def _requeue_preempted(s: Session, clock: Clock, t: Task) -> str:
    """B4: a preempted task, now stopped, goes back to the queue (its pool host ports
    are chosen again; the task it made room for is placed first by priority)."""
    ports = tuple(p.released() for p in ports_from_dicts(t.ports))
    message = f"preempted by {t.preempted_by}; queued again"
    if not transition(
        s,
        clock,
        t.id,
        TaskStatus.STOPPING,
        TaskStatus.PENDING,
        message,
        update=TaskUpdate(
            node_id=None,
            gpu_ids=(),
            ports=ports,
            preempted_by="",
            qos="",
            started_at=None,
        ),
    ):
        raise Conflict(f"task {t.id} changed concurrently; report again")
    return TaskStatus.PENDING.value


TENANTS_LABEL = "heteroflow.tenants"


def dedicated_to(labels: dict[str, Any]) -> frozenset[str]:
    """Tenants a node is dedicated to: label ``heteroflow.tenants`` = "tn-a,tn-b" (empty:
    every tenant may use and see it)."""
    raw = str(labels.get(TENANTS_LABEL, ""))
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


def list_nodes(
    s: Session, clock: Clock, offline_after_s: float, tenant_id: str | None = None
) -> list[NodeRead]:
    """Every node, or with ``tenant_id`` the ones that tenant may use (members)."""
    cutoff = clock.now() - timedelta(seconds=offline_after_s)
    rows = [
        n
        for n in s.scalars(select(Node).order_by(Node.name))
        if tenant_id is None or may_use(dedicated_to(n.labels), tenant_id)
    ]
    return [
        NodeRead(
            id=n.id,
            name=n.name,
            address=n.address,
            runtime=n.runtime,
            status="online" if n.last_heartbeat_at >= cutoff else "offline",
            gpus=[GpuCardWire(**g) for g in n.gpus],
            cpu_count=n.cpu_count,
            memory_total_mb=n.memory_total_mb,
            memory_available_mb=n.memory_available_mb,
            cpu_percent=n.cpu_percent,
            memory_percent=n.memory_percent,
            labels=dict(n.labels),
            engines={str(k): str(v) for k, v in n.engines.items()},
            models=list(n.models),
            allowed_volume_prefixes=[str(p) for p in n.allowed_volume_prefixes],
            denied_volume_prefixes=[str(p) for p in n.denied_volume_prefixes],
            host_ports_in_use=[int(p) for p in n.host_ports_in_use],
            registered_at=n.registered_at,
            last_heartbeat_at=n.last_heartbeat_at,
        )
        for n in rows
    ]


def node_engines(n: Node) -> NodeEngines:
    return engines_from(n.gpus, n.engines)


def engines_from(gpus: list[dict[str, Any]], engines: dict[str, Any]) -> NodeEngines:
    """What the engine chain reads of a node's heartbeat (its cards and probed engines);
    the one rule, used by the fleet read model and the template endpoint alike."""
    vendors = {str(g.get("vendor", "")) for g in gpus}
    vendor = sorted(vendors)[0] if len(vendors) == 1 else ("nvidia" if "nvidia" in vendors else "")
    return NodeEngines(
        vendor=vendor,
        compute_capabilities=tuple(
            str(g["compute_capability"]) for g in gpus if g.get("compute_capability")
        ),
        available={str(k): str(v) for k, v in engines.items()},
    )


def inference_templates(
    s: Session, node_id: str, tenant_id: str | None = None
) -> list[TemplateRead]:
    """A node's one-click chain; with ``tenant_id`` only for a node that tenant may use
    (a node dedicated to other tenants is not found, as in ``list_nodes``)."""
    n = s.get(Node, node_id)
    if n is None or (tenant_id is not None and not may_use(dedicated_to(n.labels), tenant_id)):
        raise NotFound(f"node {node_id!r} not found")
    return [
        TemplateRead(engine=t.engine, image=t.image, reason=t.reason)
        for t in templates_for(node_engines(n))
    ]
