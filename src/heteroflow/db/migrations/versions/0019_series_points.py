"""live time series (issue 33)

- ``series_points``: the points of the live series the leader samples every 10 s (per
  service, node and card), one row per (scope, key, step, bucket start); the primary
  key is the read's index (a series' points of one resolution in time order),
  ``ix_series_points_step_at`` the prune's. At most 1,800 rows per series (1 h of 10 s points, 24 h of minute points).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "series_points",
        sa.Column("scope", sa.String(8), primary_key=True),
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("step", sa.Integer(), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("values", sa.JSON(), nullable=False),
    )
    # the prune's: every round deletes the points past their window across all series
    op.create_index("ix_series_points_step_at", "series_points", ["step", "at"])


def downgrade() -> None:
    op.drop_index("ix_series_points_step_at", table_name="series_points")
    op.drop_table("series_points")
