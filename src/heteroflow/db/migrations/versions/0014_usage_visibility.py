"""tenancy, second part: GPU time, own-task visibility, tenant token quota (issue 16)

- ``gpu_time_segments`` (N4): one row per stretch of time a task held its cards in one
  metered state (``running``: booked and awake; ``sleeping``), with the commitment it held
  (hundredths of a card) and its owners; open while ``ended_at`` is NULL. Written by the
  one door for task state changes (services/lifecycle/transitions.py); reports clip and bucket them.
  Tasks that hold cards when this runs get an open segment from now.
- ``tasks.created_by`` (N5): the member a task belongs to — always its group's creator,
  whoever or whatever made it (create, scale, autoscale, window restore, recovery
  rebuild, rolling update). Existing tasks take their group's creator.
- ``tenants.members_see_own`` (N5): when true, the tenant's members see and manage only
  the services they created (operators see all).
- ``tenants.quota_tokens`` / ``quota_token_period`` (N2): the tenant's token budget per
  ``day`` or ``month`` at the gateway, beside each key's own; 0 = no limit.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 05:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpu_time_segments",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(32), nullable=False),
        sa.Column("group_id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("user_id", sa.String(32), nullable=False),
        sa.Column("node_id", sa.String(32), nullable=False, server_default=""),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("card_pct", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_gpu_time_task", "gpu_time_segments", ["task_id", "ended_at"])
    op.create_index("ix_gpu_time_tenant_start", "gpu_time_segments", ["tenant_id", "started_at"])
    op.create_index("ix_gpu_time_start", "gpu_time_segments", ["started_at"])
    with op.batch_alter_table("tasks", schema=None) as b:
        b.add_column(sa.Column("created_by", sa.String(32), nullable=False, server_default=""))
    op.execute(
        "UPDATE tasks SET created_by = (SELECT task_groups.created_by FROM task_groups"
        " WHERE task_groups.id = tasks.group_id)"
        " WHERE EXISTS (SELECT 1 FROM task_groups WHERE task_groups.id = tasks.group_id)"
    )
    # tasks holding cards now get a segment from now (their past is not known): the
    # commitment rule of core/quotas.task_usage as it stands at 0014, frozen here
    op.execute(
        "INSERT INTO gpu_time_segments (task_id, group_id, tenant_id, user_id, node_id,"
        " state, card_pct, started_at)"
        " SELECT id, group_id, tenant_id, created_by, COALESCE(node_id, ''),"
        " CASE WHEN status = 'sleeping' THEN 'sleeping' ELSE 'running' END,"
        " CASE WHEN gpu_required <= 0 THEN 0"
        " WHEN gpu_required > 1 OR task_type <> 'inference' THEN gpu_required * 100"
        " ELSE gpu_memory_utilization END,"
        " CURRENT_TIMESTAMP FROM tasks"
        " WHERE status IN ('scheduled', 'starting', 'running', 'waking', 'stopping',"
        " 'sleeping')"
    )
    with op.batch_alter_table("tenants", schema=None) as b:
        b.add_column(
            sa.Column("members_see_own", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        b.add_column(sa.Column("quota_tokens", sa.BigInteger(), nullable=False, server_default="0"))
        b.add_column(
            sa.Column("quota_token_period", sa.String(16), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as b:
        for col in ("quota_token_period", "quota_tokens", "members_see_own"):
            b.drop_column(col)
    with op.batch_alter_table("tasks", schema=None) as b:
        b.drop_column("created_by")
    op.drop_index("ix_gpu_time_start", table_name="gpu_time_segments")
    op.drop_index("ix_gpu_time_tenant_start", table_name="gpu_time_segments")
    op.drop_index("ix_gpu_time_task", table_name="gpu_time_segments")
    op.drop_table("gpu_time_segments")
