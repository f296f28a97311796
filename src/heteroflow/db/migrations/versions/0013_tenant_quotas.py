"""tenant quotas (N2)

- ``tenants.quota_cards`` / ``quota_services`` / ``quota_replicas`` /
  ``quota_cpu_memory_mb``: a tenant's limits (core/quotas.py); 0 = no limit, which is
  what every existing tenant gets.

Revision ID: 0013
Revises: 0012
Create Date: 2027-01-10 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

COLUMNS = ("quota_cards", "quota_services", "quota_replicas", "quota_cpu_memory_mb")


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as b:
        for col in COLUMNS:
            b.add_column(sa.Column(col, sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as b:
        for col in reversed(COLUMNS):
            b.drop_column(col)
