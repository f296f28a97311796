"""model_routes.added

A route added through the API (``POST /api/v1/model-routes``) rather than created with
its group: every key of the route's tenant may call its model, not only the keys of the
group's endpoint. Existing routes were all created with their groups (false).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 08:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_routes", schema=None) as b:
        b.add_column(sa.Column("added", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("model_routes", schema=None) as b:
        b.drop_column("added")
