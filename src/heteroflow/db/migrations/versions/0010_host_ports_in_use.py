"""host ports in use: ``nodes.host_ports_in_use``, so the port pool hands out free ports

- ``nodes.host_ports_in_use`` (JSON list of ints, default ``[]``): the TCP ports something
  listens on at the node's host, as its agent's last heartbeat reported them, plus any a
  launch found taken since (services/agents/nodes.py). The placement's port pool skips them on
  that node (P2, issue 12).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-16 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as b:
        b.add_column(
            sa.Column("host_ports_in_use", sa.JSON(), nullable=False, server_default="[]")
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as b:
        b.drop_column("host_ports_in_use")
