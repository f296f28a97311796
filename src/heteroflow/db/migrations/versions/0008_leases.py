"""leases: leader election with a fencing epoch, and the server instances list

- ``leases``: one row per named lease (``controllers``: who runs the leader-only loops);
  ``epoch`` is the fencing token (services/leadership.py).
- ``server_instances``: every ``heteroflow server`` process heartbeats its row at each
  lease renew; ``GET /api/v1/servers`` lists the recently seen ones.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "server_instances",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("address", sa.String(255), nullable=False, server_default=""),
        sa.Column("port", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("version", sa.String(64), nullable=False, server_default=""),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "ix_server_instances_last_seen_at", "server_instances", ["last_seen_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_server_instances_last_seen_at", table_name="server_instances")
    op.drop_table("server_instances")
    op.drop_table("leases")
