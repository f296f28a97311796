"""Who may touch a task: its tenant's members and operators, or the agent of its node.

Other tenants' objects answer 404 (not 403): their existence is not disclosed.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from heteroflow.core.errors import NotFound
from heteroflow.db.tables import Task
from heteroflow.services.auth import Principal


def visible_task(s: Session, who: Principal, task_id: str) -> Task:
    """The task when ``who`` may see it (its tenant, or an operator); 404 otherwise."""
    t = s.get(Task, task_id)
    if t is None or (not who.is_operator and t.tenant_id != who.tenant_id):
        raise NotFound(f"task {task_id!r} not found")
    return t


def task_on_node(s: Session, node_id: str, task_id: str) -> Task:
    """The task when it is placed on the calling agent's node; 404 otherwise."""
    t = s.get(Task, task_id)
    if t is None or not node_id or t.node_id != node_id:
        raise NotFound(f"task {task_id!r} is not placed on node {node_id!r}")
    return t
