"""Who may see and touch what: the one place for it (tenancy, issue 10; N5, issue 16).

- An operator sees everything.
- A member sees their tenant's objects; objects of other tenants answer 404 (not 403):
  their existence is not disclosed.
- A member of a tenant with ``members_see_own`` (``Principal.own_only``) sees only what
  they created: the groups whose ``created_by`` is theirs, the tasks whose ``created_by``
  is theirs (a task belongs to its group's creator whoever made it: scale, autoscale,
  recovery, rollout and schedule-window copies included; services/lifecycle/replicas.py), the
  endpoints (keys) they created and the file requests they made. Model routes: the ones
  to groups they created, whoever added them (a route names no creator; an own-only
  member can only add routes to their own groups anyway). A route an operator added
  for the tenant to another tenant's shared service is not shown to own-only members.
  Everything else of the tenant answers 404 as if it were another tenant's.
- Tenant-level facts (the tenant, its quota and users, its dedicated nodes) stay
  tenant-wide.
- An agent touches only the tasks placed on its node (``task_on_node``).

Callers use ``visible_*`` for one object (404 otherwise) and ``*_clause`` to filter a
listing; the checks themselves are the ``sees_*`` predicates.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_, select, true
from sqlalchemy.orm import Session

from heteroflow.core.errors import NotFound
from heteroflow.db.tables import FileRequest, InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.services.identity.auth import Principal


def _sees(who: Principal, tenant_id: str, owner: str) -> bool:
    if who.is_operator:
        return True
    if tenant_id != who.tenant_id:
        return False
    return not who.own_only or owner == who.user_id


# ---- task groups -----------------------------------------------------------------------


def sees_group(who: Principal, g: TaskGroup) -> bool:
    """Deleted or not: callers decide what a deleted group answers."""
    return _sees(who, g.tenant_id, g.created_by)


def visible_group(
    s: Session, who: Principal, group_id: str, *, deleted: bool = False
) -> TaskGroup:
    """The group when ``who`` may see it; 404 otherwise, and for a deleted group unless
    ``deleted`` (the caller then answers for it itself)."""
    g = s.get(TaskGroup, group_id)
    if g is None or (g.deleted_at is not None and not deleted) or not sees_group(who, g):
        raise NotFound(f"task group {group_id!r} not found")
    return g


def group_clause(who: Principal) -> ColumnElement[bool]:
    """Filters a query of ``TaskGroup`` to what ``who`` sees."""
    if who.is_operator:
        return true()
    if who.own_only:
        return and_(TaskGroup.tenant_id == who.tenant_id, TaskGroup.created_by == who.user_id)
    return TaskGroup.tenant_id == who.tenant_id


# ---- tasks -------------------------------------------------------------------------------


def sees_task(who: Principal, t: Task) -> bool:
    return _sees(who, t.tenant_id, t.created_by)


def visible_task(s: Session, who: Principal, task_id: str) -> Task:
    """The task when ``who`` may see it (see the module docstring); 404 otherwise."""
    t = s.get(Task, task_id)
    if t is None or not sees_task(who, t):
        raise NotFound(f"task {task_id!r} not found")
    return t


def task_on_node(s: Session, node_id: str, task_id: str) -> Task:
    """The task when it is placed on the calling agent's node; 404 otherwise."""
    t = s.get(Task, task_id)
    if t is None or not node_id or t.node_id != node_id:
        raise NotFound(f"task {task_id!r} is not placed on node {node_id!r}")
    return t


# ---- endpoints (keys) -----------------------------------------------------------------


def sees_endpoint(who: Principal, e: InferenceEndpoint) -> bool:
    return _sees(who, e.tenant_id, e.created_by)


def visible_endpoint(s: Session, who: Principal, endpoint_id: str) -> InferenceEndpoint:
    e = s.get(InferenceEndpoint, endpoint_id)
    if e is None or not sees_endpoint(who, e):
        raise NotFound(f"endpoint {endpoint_id!r} not found")
    return e


def endpoint_clause(who: Principal) -> ColumnElement[bool]:
    """Filters a query of ``InferenceEndpoint`` to what ``who`` sees."""
    if who.is_operator:
        return true()
    if who.own_only:
        return and_(
            InferenceEndpoint.tenant_id == who.tenant_id,
            InferenceEndpoint.created_by == who.user_id,
        )
    return InferenceEndpoint.tenant_id == who.tenant_id


# ---- model routes -----------------------------------------------------------------------


def _own_groups(who: Principal) -> ColumnElement[bool]:
    mine = select(TaskGroup.id).where(
        TaskGroup.tenant_id == who.tenant_id, TaskGroup.created_by == who.user_id
    )
    return ModelRoute.group_id.in_(mine)


def route_clause(who: Principal) -> ColumnElement[bool]:
    """Filters a query of ``ModelRoute`` to what ``who`` sees: own-only members, the
    routes of their tenant to the groups they created."""
    if who.is_operator:
        return true()
    if who.own_only:
        return and_(ModelRoute.tenant_id == who.tenant_id, _own_groups(who))
    return ModelRoute.tenant_id == who.tenant_id


def visible_route(s: Session, who: Principal, route_id: str) -> ModelRoute:
    r = s.scalar(select(ModelRoute).where(ModelRoute.id == route_id, route_clause(who)))
    if r is None:
        raise NotFound(f"model route {route_id!r} not found")
    return r


# ---- file requests -----------------------------------------------------------------------


def visible_file_request(s: Session, who: Principal, request_id: str) -> FileRequest:
    fr = s.get(FileRequest, request_id)
    if fr is None or not _sees(who, fr.tenant_id, fr.requested_by):
        raise NotFound(f"file request {request_id!r} not found")
    return fr
