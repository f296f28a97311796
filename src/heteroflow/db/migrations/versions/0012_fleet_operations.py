"""fleet operations: schedule windows, rollouts, the autoscaler

- ``task_groups.window_action`` ("" | pause | scale | stop) and
  ``window_saved_replicas`` (K1): what the window executor put in effect and the replica
  count it saved first.
- ``task_groups.rollout_holder`` / ``rollout_expires_at`` / ``rollout_started_at`` /
  ``rollout_spec`` (J1, J4): a rolling update's execution lease and what it rolls out.
- ``task_groups.autoscaled_at`` (I1): the autoscaler's last decision.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-18 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("task_groups", schema=None) as b:
        b.add_column(sa.Column("window_action", sa.String(16), nullable=False, server_default=""))
        b.add_column(sa.Column("window_saved_replicas", sa.Integer(), nullable=True))
        b.add_column(sa.Column("rollout_holder", sa.String(64), nullable=False, server_default=""))
        b.add_column(sa.Column("rollout_expires_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("rollout_started_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("rollout_spec", sa.JSON(), nullable=False, server_default="{}"))
        b.add_column(sa.Column("autoscaled_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("task_groups", schema=None) as b:
        for col in (
            "autoscaled_at", "rollout_spec", "rollout_started_at", "rollout_expires_at",
            "rollout_holder", "window_saved_replicas", "window_action",
        ):
            b.drop_column(col)
