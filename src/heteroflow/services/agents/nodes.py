"""Nodes and the agent protocol: heartbeat (register + desired tasks), claim, report.

Faults seen here become group-level fault events (E2, ``services.faults``): a card that
vanished from a heartbeat's inventory (``fault.gpu_lost``) and a failed report that
names its fault (``fault.container_lost`` / ``engine_exited`` / ``unhealthy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import orjson
from sqlalchemy import (
    Connection,
    Row,
    Text,
    and_,
    bindparam,
    cast,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.engines.selection import NodeEngines
from heteroflow.core.engines.templates import inference_templates as templates_for
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.events import EventKind
from heteroflow.core.ids import new_id
from heteroflow.core.placement.model import may_use
from heteroflow.core.ports import ports_from_dicts
from heteroflow.core.states import NOTE_TARGETS, RESTARTED_WITH_AGENT, TaskStatus
from heteroflow.db.tables import Event, Node, Task, TaskGroup
from heteroflow.schemas.nodes import (
    CachedModelWire,
    GpuCardWire,
    Heartbeat,
    HeartbeatReply,
    NodeRead,
    TaskAssignment,
    TaskReport,
    TemplateRead,
)
from heteroflow.services.agents.copies import model_peers
from heteroflow.services.identity.access import task_on_node
from heteroflow.services.lifecycle import faults
from heteroflow.services.lifecycle.transitions import KEEP, TaskUpdate, note, transition
from heteroflow.services.placement.gangs import gang_place, gang_places_of

# What an agent is told about: tasks placed on it that it should be starting or running,
# and the ones asleep there (their engines stay stopped, their containers kept) or waking.
DESIRED = (
    TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.SLEEPING,
    TaskStatus.WAKING,
)


# Columns a heartbeat reports that rarely change between two beats (the agent rescans
# models every minute; ports, labels and volume rules move with the operator): written
# only when the stored JSON differs, so a steady node's beat rewrites no large value.
STEADY_COLUMNS = (
    "labels", "models", "engines", "allowed_volume_prefixes", "denied_volume_prefixes",
    "host_ports_in_use",
)

# The heartbeat's statements, built once: Core on the tables (no ORM objects, no
# statement construction per beat; SQLAlchemy caches their compiled form).
_NODES = Node.metadata.tables[Node.__tablename__]
_TASKS = Task.metadata.tables[Task.__tablename__]
_GROUPS = TaskGroup.metadata.tables[TaskGroup.__tablename__]
# SET takes the columns named in the parameters (those that changed)
_UPDATE_NODE = update(_NODES).where(_NODES.c.id == bindparam("node_id_"))
_INSERT_NODE = insert(_NODES)
# One read for a batch of beats: per node its id, name and cards, the stored text of
# each steady column (compared with the beat's in Python: the text is what the engine
# wrote, so equal text means an equal value), and the tasks the agent should run
# (``assignment``'s columns), one row each (or one row without a task).
_FIND_NODES = (
    select(
        _NODES.c.id.label("node_id"),
        _NODES.c.name.label("node_name"),
        _NODES.c.gpus.label("node_gpus"),
        *(cast(_NODES.c[k], Text).label(f"text_{k}") for k in STEADY_COLUMNS),
        *(
            _TASKS.c[k]
            for k in (
                "id", "group_id", "name", "status", "task_type", "model_name", "model_path",
                "image", "engine", "command", "engine_args", "env", "ports", "gpu_ids",
                "gpu_required", "memory_mb", "kv_offload_gb", "generation",
                "gpu_memory_utilization", "health_check", "volumes",
                "max_loras", "rank",
            )
        ),
        _GROUPS.c.parallelism,
        _GROUPS.c.lora_adapters,  # loaded into the running engine (core.lora)
    )
    .select_from(
        _NODES.outerjoin(
            _TASKS,
            and_(
                _TASKS.c.node_id == _NODES.c.id,
                _TASKS.c.status.in_([d.value for d in DESIRED]),
            ),
        ).outerjoin(_GROUPS, _GROUPS.c.id == _TASKS.c.group_id)
    )
    .where(_NODES.c.name.in_(bindparam("names", expanding=True)))
    .order_by(_NODES.c.name, _TASKS.c.created_at)
)


def reported_columns(hb: Heartbeat) -> dict[str, Any]:
    """The ``nodes`` columns a heartbeat sets, as they are stored (besides the time)."""
    inv = hb.inventory
    return {
        "address": hb.address,
        "runtime": hb.runtime,
        "gpus": [g.model_dump() for g in inv.gpus],
        "cpu_count": inv.cpu_count,
        "memory_total_mb": inv.memory_total_mb,
        "memory_available_mb": inv.memory_available_mb,
        "cpu_percent": inv.cpu_percent,
        "memory_percent": inv.memory_percent,
        "labels": dict(hb.labels),
        # issue 29: the cache's models beside the scan's, marked by "source" (the path a
        # console deploy fills in is the source: services/placement/fleet.py reads them)
        "models": [m.model_dump() for m in hb.models] + [cached_entry(c) for c in hb.model_cache],
        "engines": dict(hb.engines),
        # C4 volume rules: create refuses an absolute model_path no node the caller may use
        # allows
        "allowed_volume_prefixes": list(hb.allowed_volume_prefixes),
        "denied_volume_prefixes": list(hb.denied_volume_prefixes),
        "host_ports_in_use": sorted(set(hb.host_ports_in_use)),  # the pool skips them (P2)
        "peer_url": hb.peer_url,  # issue 29: where it serves its cache to the other agents
    }


def cached_entry(c: CachedModelWire) -> dict[str, Any]:
    """A cache entry as the ``models`` column keeps it: the scan's shape (name, path,
    format, size) so a model list shows it, and ``source``, ``revision``, ``key``,
    ``state`` for placement (``services.placement.fleet``)."""
    return {"name": c.source, "path": c.source, "format": "cache", "size_bytes": c.size_bytes,
            "files": [], "mtime": 0.0, "source": c.source, "revision": c.revision,
            "key": c.key, "state": c.state}


def changed_columns(
    reported: dict[str, Any], stored_gpus: list[Any], steady_same: dict[str, bool]
) -> dict[str, Any]:
    """What of ``reported`` to write: everything but the cards when they equal the stored
    ones and the steady columns whose stored JSON text is the one this beat would write
    (``steady_same``; a column not named there is written)."""
    return {
        k: v
        for k, v in reported.items()
        if not (k == "gpus" and v == stored_gpus) and not steady_same.get(k, False)
    }


def _json_text(value: Any) -> str:
    """A column's value as the engine writes it (orjson, ``db.engine``): equal text means
    an equal stored value; different text only costs a write that was not needed."""
    return orjson.dumps(value).decode()


def heartbeat(s: Session, clock: Clock, hb: Heartbeat) -> HeartbeatReply:
    """Register or refresh the node; the reply lists the tasks it should run.

    The whole path, in the caller's transaction: registers a new node, and writes a
    card that vanished (``fault.gpu_lost``) with the refresh. The common beat goes
    through ``refresh_many`` instead.
    """
    now = clock.now()
    reported = reported_columns(hb)
    rows = _find(s, [hb.name]).get(hb.name)
    if not rows:
        node_id = new_id("node")
        s.execute(
            _INSERT_NODE,
            {"id": node_id, "name": hb.name, "registered_at": now, "last_heartbeat_at": now,
             **reported},
        )
        return HeartbeatReply(node_id=node_id, tasks=[])  # a new id has no tasks yet
    vanished = _vanished(rows[0], hb)
    if vanished:  # lost (all of them when NVML stops answering): fault.gpu_lost per group
        node = s.get(Node, str(rows[0].node_id))
        if node is not None:
            faults.gpu_lost(s, clock, node, vanished)
    write, reply = _refreshed(rows, reported, now)
    s.execute(_UPDATE_NODE, write)
    _with_gangs(s, [reply])
    return reply


def refresh_many(
    conn: Connection, clock: Clock, beats: Sequence[Heartbeat]
) -> list[HeartbeatReply | None]:
    """The common beats of known nodes, a batch at once, on an autocommit connection:
    one read for them all (``_FIND_NODES``) and one UPDATE statement per set of changed
    columns, its rows sent together (an executemany: psycopg pipelines them) — a few
    round trips for the batch, no transaction: each row is one node's own write.

    A reply per beat, in order; None, having written nothing for it, for a beat that
    needs ``heartbeat``'s transaction (a new node, a card gone). Of two beats of one node
    in the batch only the later writes or takes the transaction: it is the newer state,
    and an older change must not land after it (the earlier gets the stored task list).
    The hot path of the control plane (every node, every 5 s; ``bench/control_plane.py``).
    """
    now = clock.now()
    found = _find(conn, list({hb.name for hb in beats}))
    last = {hb.name: i for i, hb in enumerate(beats)}
    replies: list[HeartbeatReply | None] = []
    writes: dict[frozenset[str], list[dict[str, Any]]] = {}
    for i, hb in enumerate(beats):
        rows = found.get(hb.name)
        newest = last[hb.name] == i
        if not rows or (newest and _vanished(rows[0], hb)):
            replies.append(None)
            continue
        write, reply = _refreshed(rows, reported_columns(hb), now)
        if newest:
            writes.setdefault(frozenset(write), []).append(write)
        replies.append(reply)
    for rows_alike in writes.values():
        conn.execute(_UPDATE_NODE, rows_alike)
    return _with_gangs(conn, replies)


def _with_gangs(
    db: Session | Connection, replies: list[HeartbeatReply | None]
) -> list[HeartbeatReply | None]:
    """G1 / issue 32: each pipeline stage listed with its place in its gang, as its claim
    gave it (a wake relaunches the stage from what the heartbeat lists) — one more read
    for the batch, only when it lists a pipeline stage."""
    stages = [t for r in replies if r is not None for t in r.tasks if t.parallelism == "pipeline"]
    if not stages:
        return replies
    places = gang_places_of(db, {(t.group_id, t.generation) for t in stages})
    for t in stages:
        place = places.get(t.id)
        t.gang = place.to_dict() if place is not None else None
    return replies


def _find(db: Session | Connection, names: list[str]) -> dict[str, list[Any]]:
    """``_FIND_NODES``'s rows by node name (a name not stored is absent)."""
    found: dict[str, list[Any]] = {}
    for row in db.execute(_FIND_NODES, {"names": names}):
        found.setdefault(row.node_name, []).append(row)
    return found


def _vanished(found: Any, hb: Heartbeat) -> list[Any]:
    """The stored cards this beat's inventory no longer lists."""
    listed = {g.index for g in hb.inventory.gpus}
    return [g for g in found.node_gpus if int(g["index"]) not in listed]


def _refreshed(
    rows: list[Any], reported: dict[str, Any], now: Any
) -> tuple[dict[str, Any], HeartbeatReply]:
    """The node's UPDATE parameters (the time and what changed) and the reply, from
    ``_find``'s rows of that node."""
    found = rows[0]
    node_id = str(found.node_id)
    steady_same = {
        k: found._mapping[f"text_{k}"] == _json_text(reported[k]) for k in STEADY_COLUMNS
    }
    write = {
        "node_id_": node_id,
        "last_heartbeat_at": now,
        **changed_columns(reported, list(found.node_gpus), steady_same),
    }
    reply = HeartbeatReply(
        node_id=node_id,
        tasks=[_assigned(r) for r in rows if r.id is not None],
    )
    return write, reply


def _assigned(row: Row[*tuple[Any, ...]]) -> TaskAssignment:
    """A task of ``_FIND_NODES``'s rows: its columns and its group's ``parallelism``, by
    name (the node's columns are ignored). Validated from a dict, which is faster than
    the row's attributes: the heartbeat's reply is the control plane's hot path."""
    return TaskAssignment.model_validate(dict(row._mapping))


def assignment(t: Task, parallelism: str) -> TaskAssignment:
    """A task read from its row by name, with its group's parallelism."""
    read = TaskAssignment.model_validate(t, from_attributes=True)
    return read.model_copy(update={"parallelism": parallelism})


def claim(
    s: Session, clock: Clock, node_id: str, task_id: str, *, offline_after_s: float = 30.0
) -> TaskAssignment:
    """scheduled -> starting, by CAS: exactly one agent wins a task. A model source comes
    with the nodes it can be copied from (issue 29, ``services.agents.copies``)."""
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
    read = assignment(t, group.parallelism if group else "single")
    if read.parallelism == "pipeline":  # G1: where its gang meets (services/placement/gangs)
        place = gang_place(s, t)
        read = read.model_copy(update={"gang": place.to_dict() if place else None})
    peers = model_peers(s, clock, node_id, t.id, t.model_path, offline_after_s=offline_after_s)
    if peers:
        read = read.model_copy(update={"model_peers": peers})
    return read


# Which reported outcome moves a task from which state.
_REPORT_FROM: dict[TaskStatus, tuple[TaskStatus, ...]] = {
    TaskStatus.RUNNING: (TaskStatus.STARTING, TaskStatus.WAKING),
    TaskStatus.FAILED: (
        TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.STOPPING, TaskStatus.SLEEPING,
        TaskStatus.WAKING,
    ),
    TaskStatus.COMPLETED: (TaskStatus.STARTING, TaskStatus.RUNNING),
    # the engine stopped with its own agent: the same placement is started again when the
    # agent is back (no fault, no rebuild: a restart is not the service's failure)
    TaskStatus.SCHEDULED: tuple(RESTARTED_WITH_AGENT),
    TaskStatus.STOPPED: (
        TaskStatus.STOPPING, TaskStatus.STARTING, TaskStatus.RUNNING, TaskStatus.SLEEPING,
        TaskStatus.WAKING,
    ),
}


# A note's kind -> the event it writes (None: the status message alone).
_NOTE_EVENT: dict[str | None, EventKind | None] = {
    None: EventKind.LAUNCH_RETRY,  # the launch is being retried, and why (P2)
    "loading": EventKind.LOADING,  # D5: a load window opened (size, expected time)
    "progress": None,  # D5: how far the load is, every few seconds: no event
    "pull": EventKind.IMAGE_PULL,  # H7: an image pull began or ended on the node
    "pulling": None,  # H7: how far the pull is (summed over layers): no event
    "fetch": EventKind.MODEL_FETCH,  # issue 29: a model source's fetch began or ended
    "fetching": None,  # issue 29: how far the fetch is: no event
    "asleep": None,  # F1: how its engine sleeps (kept, or stopped and why)
}


def report(s: Session, clock: Clock, node_id: str, task_id: str, rep: TaskReport) -> str:
    """Apply an agent's report; returns the task's status afterwards.

    A report that names a fault writes its ``fault.*`` event in the same transaction,
    only when the task really fails (not for a repeat, nor for a task being stopped).
    """
    t = task_on_node(s, node_id, task_id)
    to = TaskStatus(rep.status)
    current = TaskStatus(t.status)
    if rep.note == "adapter":  # LoRA: what a running engine serves (agent/adapters.py)
        if current != to:
            raise Conflict(f"task {task_id} is {current}; an adapter note is for running")
        note(s, clock, t.id, current, EventKind.LORA_ADAPTER, rep.message, node_id)
        return current.value
    if to in NOTE_TARGETS:  # a note: a launch retried, or how a load goes (D5)
        if current != to:
            raise Conflict(f"task {task_id} is {current}; cannot note it as {to}")
        kind = _NOTE_EVENT[rep.note]
        note(s, clock, t.id, current, kind, rep.message, node_id)
        return current.value
    if to == TaskStatus.PENDING:
        return _ports_taken(s, clock, node_id, t, rep.busy_ports, rep.message)
    if current == TaskStatus.STOPPING and to in (TaskStatus.FAILED, TaskStatus.SCHEDULED):
        to = TaskStatus.STOPPED  # it was asked to stop; an exit on the way is still a stop
    if rep.argv is not None:
        t.launch_argv = list(rep.argv)
    if current == to:
        return current.value
    if current not in _REPORT_FROM[to]:
        raise Conflict(f"task {task_id} is {current}; cannot report {to}")
    if current == TaskStatus.SLEEPING and to == TaskStatus.FAILED and _in_gang(s, t):
        # issue 32: a stage whose peers were stopped for the gang's sleep may exit before
        # its own agent stops it; it was meant to stop: still asleep, woken with the gang
        said = rep.message.splitlines()[0] if rep.message else "its engine exited"
        note(s, clock, t.id, current, None, f"asleep with its gang ({said})", node_id)
        return current.value
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


def _in_gang(s: Session, t: Task) -> bool:
    group = s.get(TaskGroup, t.group_id)
    return group is not None and group.parallelism == "pipeline"


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
            peer_url=n.peer_url,
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
