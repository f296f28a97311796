"""the service's life: recovery, sleep and wake, user stop, run timeout, idle timer

- ``tasks.rebuild_count`` (E1): rebuilds in a row behind this task; ``tasks.replaced_by``:
  the task that replaced it ("" = current; the group's derived status reads current
  tasks only); ``tasks.running_at``: when it last became running (E1's 60 s stability
  window, A10's run timeout); ``tasks.wake_requested`` (F3): a wake that could not
  happen yet.
- ``task_groups.desired``: "running" or "stopped" (a user stop); ``run_timeout_seconds``
  (A10); ``last_request_at`` (F4): the last request the gateway routed to the group.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-17 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as b:
        b.add_column(sa.Column("rebuild_count", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("replaced_by", sa.String(32), nullable=False, server_default=""))
        b.add_column(sa.Column("running_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(
            sa.Column("wake_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("task_groups", schema=None) as b:
        b.add_column(
            sa.Column("desired", sa.String(16), nullable=False, server_default="running")
        )
        b.add_column(
            sa.Column("run_timeout_seconds", sa.Integer(), nullable=False, server_default="0")
        )
        b.add_column(sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("task_groups", schema=None) as b:
        b.drop_column("last_request_at")
        b.drop_column("run_timeout_seconds")
        b.drop_column("desired")
    with op.batch_alter_table("tasks", schema=None) as b:
        b.drop_column("wake_requested")
        b.drop_column("running_at")
        b.drop_column("replaced_by")
        b.drop_column("rebuild_count")
