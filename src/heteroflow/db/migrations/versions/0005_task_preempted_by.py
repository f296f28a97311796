"""tasks.preempted_by

The id of the task a preempted task makes room for (B4): while set, the task is being
stopped to free its cards and goes back to the queue, not to ``stopped``, once its
agent confirms the stop.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 08:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as b:
        b.add_column(
            sa.Column("preempted_by", sa.String(length=32), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as b:
        b.drop_column("preempted_by")
