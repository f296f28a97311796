"""typed events: ``events.node_id``, so no code reads a node out of a message again

- ``events.node_id`` (nullable, indexed): the node a fault concerns. The node watch
  (services/lifecycle/faults.py) finds a node's recorded lost/back state by ``node_id`` + ``kind``.
- Backfill, the last time a message is parsed: every ``fault.node_lost`` /
  ``fault.node_back`` row (node-level and per group) written before this revision. Their
  messages start with ``node <name> `` (names never contain a space) and the node-level
  ones end with ``(node id <id>)``; the id wins, else the name is looked up in
  ``nodes``. A row whose node is gone keeps NULL (no later round can match it anyway).
  Older ``fault.gpu_lost`` and agent-reported fault rows keep NULL: nothing reads them
  by node.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-09 10:00:00.000000
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op


revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_MARKS = ("fault.node_lost", "fault.node_back")
_NODE_ID = re.compile(r"\(node id ([A-Za-z0-9_-]+)\)")

events = sa.table(
    "events",
    sa.column("id", sa.Integer()),
    sa.column("kind", sa.String()),
    sa.column("message", sa.Text()),
    sa.column("node_id", sa.String()),
)
nodes = sa.table("nodes", sa.column("id", sa.String()), sa.column("name", sa.String()))


def _node_name(message: str) -> str:
    parts = message.split(" ", 2)
    return parts[1] if len(parts) > 1 and parts[0] == "node" else ""


def upgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("node_id", sa.String(32), nullable=True))
        batch_op.create_index(batch_op.f("ix_events_node_id"), ["node_id"], unique=False)

    conn = op.get_bind()
    by_name = {name: nid for nid, name in conn.execute(sa.select(nodes.c.id, nodes.c.name))}
    known = set(by_name.values())
    rows = conn.execute(
        sa.select(events.c.id, events.c.message).where(
            events.c.kind.in_(_MARKS), events.c.node_id.is_(None)
        )
    )
    fills: list[dict[str, object]] = []
    for event_id, message in rows:
        text = message or ""
        found = _NODE_ID.search(text)
        node_id = found.group(1) if found and found.group(1) in known else None
        node_id = node_id or by_name.get(_node_name(text))
        if node_id:
            fills.append({"b_id": event_id, "b_node": node_id})
    if fills:
        conn.execute(
            sa.update(events)
            .where(events.c.id == sa.bindparam("b_id"))
            .values(node_id=sa.bindparam("b_node")),
            fills,
        )


def downgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_node_id"))
        batch_op.drop_column("node_id")
