"""The ``heteroflow models`` verbs on the server (issue 29, H9): the fleet's cached models,
and an operator's pull or eviction on one node, carried out by that node's agent.

The flow is the file requests' (``services.agents.files``): the operator creates a
request (``pending``); the node's agent claims it through its poll by compare-and-set
(``pending -> running``, one claim wins), reports progress on it and then ``done`` or
``failed`` with why; the operator reads it. The rules (``core.model_requests``): a pull
takes a source, never a path; one open request per node and source (or key) — a second
pull answers the first; a running request the agent no longer names at its poll was lost
and fails; a request on a node that stopped heartbeating fails when read. Each request
that ends writes one node-level event (``node.model_pulled``, ``node.model_evicted``,
``node.model_request_failed``: ``group_id`` NULL, ``node_id`` the node).

Operators only: the cache is the node's, shared by every tenant (a listing would tell a
tenant what others run; a pull spends the node's disk and the platform's hub token).

What a node holds is read from its heartbeat (``nodes.models``, the entries marked by
``source``: ``services.agents.nodes.cached_entry``), never by asking the agent: the list
answers for offline nodes too, as their last beat said.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, Forbidden, NotFound
from heteroflow.core.ids import new_id
from heteroflow.core.model_requests import (
    OPEN,
    Action,
    ModelRequestStatus,
    finished_event,
    pull_source,
    what,
)
from heteroflow.db.tables import Event, ModelRequest, Node
from heteroflow.schemas.model_requests import (
    AgentModelRequest,
    CachedModelRead,
    ModelEvict,
    ModelPull,
    ModelRequestRead,
    ModelRequestReport,
)
from heteroflow.services.agents.copies import model_peers
from heteroflow.services.identity.auth import Principal

S = ModelRequestStatus
CLAIM_BATCH = 16


def _operator(who: Principal) -> None:
    if not who.is_operator:
        raise Forbidden("only a platform operator lists, pulls or evicts the nodes' models")


def _node(s: Session, ref: str) -> Node:
    """A node by id, else by name; 404 naming what was asked."""
    node = s.get(Node, ref) or s.scalar(select(Node).where(Node.name == ref))
    if node is None:
        raise NotFound(f"node {ref!r} not found", field="node")
    return node


def _offline(node: Node, clock: Clock, offline_after_s: float) -> bool:
    return clock.now() - node.last_heartbeat_at > timedelta(seconds=offline_after_s)


# -- the fleet's cached models ----------------------------------------------------------
def cached_models(s: Session, who: Principal, node_ref: str | None) -> list[CachedModelRead]:
    """Every node's cache entries (or one node's), by node name then key."""
    _operator(who)
    nodes = [_node(s, node_ref)] if node_ref else list(s.scalars(select(Node)))
    out: list[CachedModelRead] = []
    for n in sorted(nodes, key=lambda n: n.name):
        entries = [m for m in n.models if isinstance(m, dict) and m.get("source")]
        for m in sorted(entries, key=lambda m: str(m.get("key", ""))):
            out.append(CachedModelRead(
                node_id=n.id, node=n.name, key=str(m.get("key", "")),
                source=str(m["source"]), revision=str(m.get("revision", "")),
                size_bytes=int(m.get("size_bytes") or 0),
                state=str(m.get("state") or "complete"),
            ))
    return out


# -- an operator's requests -------------------------------------------------------------
def _read(mr: ModelRequest, node_name: str) -> ModelRequestRead:
    return ModelRequestRead.model_validate(
        {**{c: getattr(mr, c) for c in _COLUMNS}, "node": node_name}
    )


_COLUMNS = (
    "id", "node_id", "action", "source", "key", "status", "message", "done_bytes",
    "total_bytes", "requested_by", "created_at", "updated_at",
)


def request_pull(
    s: Session, who: Principal, clock: Clock, node_ref: str, body: ModelPull,
    offline_after_s: float,
) -> ModelRequestRead:
    _operator(who)
    source = pull_source(body.source)  # 400 naming ``source`` before the node is read
    return _request(s, who, clock, node_ref, "pull", source.text, "", offline_after_s)


def request_evict(
    s: Session, who: Principal, clock: Clock, node_ref: str, body: ModelEvict,
    offline_after_s: float,
) -> ModelRequestRead:
    _operator(who)
    return _request(s, who, clock, node_ref, "evict", "", body.key, offline_after_s)


def _request(
    s: Session, who: Principal, clock: Clock, node_ref: str, action: Action, source: str,
    key: str, offline_after_s: float,
) -> ModelRequestRead:
    """The open request for the same thing on the node, else a new one. The node's row is
    written first (a no-op update): it serialises two requests for one node (a row lock
    on PostgreSQL, the write lock on SQLite), so the second sees the first's row and
    answers it instead of adding a twin."""
    node = _node(s, node_ref)
    if _offline(node, clock, offline_after_s):
        raise Conflict(
            f"node {node.name} is offline (no heartbeat for over {offline_after_s:.0f} s): "
            f"its agent cannot take a {action} now",
            field="node",
        )
    s.execute(
        update(Node).where(Node.id == node.id).values(name=Node.name)
        .execution_options(synchronize_session=False)
    )
    same = ModelRequest.source == source if action == "pull" else ModelRequest.key == key
    existing = s.scalar(
        select(ModelRequest)
        .where(ModelRequest.node_id == node.id, ModelRequest.action == action, same,
               ModelRequest.status.in_([st.value for st in OPEN]))
        .order_by(ModelRequest.created_at)
        .limit(1)
    )
    if existing is not None:
        return _read(existing, node.name)
    now = clock.now()
    mr = ModelRequest(
        id=new_id("mrq"), node_id=node.id, action=action, source=source, key=key,
        status=S.PENDING.value, message="", done_bytes=0, total_bytes=0,
        requested_by=who.user_id, created_at=now, updated_at=now,
    )
    s.add(mr)
    s.flush()
    return _read(mr, node.name)


def get_request(
    s: Session, who: Principal, clock: Clock, request_id: str, offline_after_s: float
) -> ModelRequestRead:
    _operator(who)
    mr = s.get(ModelRequest, request_id)
    if mr is None:
        raise NotFound(f"model request {request_id!r} not found")
    node = s.get(Node, mr.node_id)
    name = node.name if node is not None else mr.node_id
    if S(mr.status) in OPEN and (node is None or _offline(node, clock, offline_after_s)):
        why = f"node {name} went offline (no heartbeat for over {offline_after_s:.0f} s)"
        if _end(s, clock, mr, S(mr.status), S.FAILED, f"{why}; ask again when it is back"):
            s.refresh(mr)
    return _read(mr, name)


# -- the agent's side -------------------------------------------------------------------
def claim(
    s: Session, clock: Clock, node_id: str, held: Sequence[str], offline_after_s: float
) -> list[AgentModelRequest]:
    """Fail this node's running requests its agent no longer holds (lost: a restart, a
    claim that never arrived), then claim its pending ones (pending -> running); a pull
    names the other nodes holding a copy, as a launch's claim does."""
    kept = set(held)
    for mr in list(s.scalars(select(ModelRequest).where(
        ModelRequest.node_id == node_id, ModelRequest.status == S.RUNNING.value
    ))):
        if mr.id not in kept:
            _end(s, clock, mr, S.RUNNING, S.FAILED,
                 "the node's agent no longer works on it (it restarted, or its claim was "
                 "lost); ask again")
    pending = s.scalars(
        select(ModelRequest)
        .where(ModelRequest.node_id == node_id, ModelRequest.status == S.PENDING.value)
        .order_by(ModelRequest.created_at)
        .limit(CLAIM_BATCH)
    )
    claimed = [mr for mr in list(pending) if _move(s, clock, mr.id, S.PENDING, S.RUNNING, {})]
    return [
        AgentModelRequest(
            id=mr.id, action="pull" if mr.action == "pull" else "evict", source=mr.source,
            key=mr.key,
            peers=model_peers(s, clock, node_id, mr.id, mr.source,
                              offline_after_s=offline_after_s) if mr.action == "pull" else [],
        )
        for mr in claimed
    ]


def report(
    s: Session, clock: Clock, node_id: str, request_id: str, rep: ModelRequestReport
) -> ModelRequestStatus:
    """The agent's progress or outcome on a request it claimed; 404 when it is not this
    node's, 409 when it is not running any more (failed by the server meanwhile)."""
    mr = s.get(ModelRequest, request_id)
    if mr is None or not node_id or mr.node_id != node_id:
        raise NotFound(f"model request {request_id!r} is not this node's")
    if mr.status != S.RUNNING:
        raise Conflict(f"model request {mr.id} is {mr.status}, not running")
    values: dict[str, object] = {"done_bytes": rep.done_bytes, "total_bytes": rep.total_bytes}
    if rep.key and mr.action == "pull":
        values["key"] = rep.key
    status = S(rep.status)
    if status is S.RUNNING:
        if not _move(s, clock, mr.id, S.RUNNING, S.RUNNING, {**values, "message": rep.message}):
            raise Conflict(f"model request {mr.id} changed concurrently")
        return status
    message = rep.message or ("failed on the node (no reason given)" if status is S.FAILED
                              else "done")
    if not _end(s, clock, mr, S.RUNNING, status, message, values):
        raise Conflict(f"model request {mr.id} changed concurrently")
    return status


def _move(
    s: Session, clock: Clock, request_id: str, expected: ModelRequestStatus,
    to: ModelRequestStatus, values: dict[str, object],
) -> bool:
    """Compare-and-set of a request's status (and ``values``); False when someone moved
    it first."""
    outcome = s.execute(
        update(ModelRequest)
        .where(ModelRequest.id == request_id, ModelRequest.status == expected.value)
        .values(status=to.value, updated_at=clock.now(), **values)
        .execution_options(synchronize_session=False)
    )
    return outcome.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def _end(
    s: Session, clock: Clock, mr: ModelRequest, expected: ModelRequestStatus,
    to: ModelRequestStatus, message: str, values: dict[str, object] | None = None,
) -> bool:
    """Move an open request to its end and write its one node-level event."""
    if not _move(s, clock, mr.id, expected, to, {**(values or {}), "message": message}):
        return False
    action: Action = "pull" if mr.action == "pull" else "evict"
    node = s.get(Node, mr.node_id)
    name = node.name if node is not None else mr.node_id
    subject = what(action, mr.source, mr.key)
    verdict = "failed" if to is S.FAILED else "done"
    s.add(Event(
        group_id=None, task_id=None, node_id=mr.node_id,
        kind=finished_event(action, to).value, from_status=expected.value,
        to_status=to.value, created_at=clock.now(),
        message=f"{subject} on node {name} {verdict} (request {mr.id}): {message}",
    ))
    return True
