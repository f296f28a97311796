"""the service of a usage record is kept with it (issue 33)

- ``usage_records.group_id``: the service (task group) of the record's endpoint, looked
  up when the gateway's batch is written, as its tenant and member are. A report by
  service read it through the endpoint, which is deleted with its service: a deleted
  service's tokens fell under no service while its GPU time (kept per task) stayed under
  its id — the usage page showed it twice. Existing rows take their endpoint's service
  where the endpoint still exists; the rows of endpoints deleted before this stay
  without one (nothing left says whose they were).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as b:
        b.add_column(sa.Column("group_id", sa.String(32), nullable=True))
        b.create_index("ix_usage_records_group_id", ["group_id"], unique=False)
    op.execute(
        "UPDATE usage_records SET group_id = (SELECT e.group_id FROM inference_endpoints e"
        " WHERE e.id = usage_records.endpoint_id)"
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as b:
        b.drop_index("ix_usage_records_group_id")
        b.drop_column("group_id")
