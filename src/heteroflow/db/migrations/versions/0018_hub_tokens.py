"""per-tenant hub tokens (issue 29 item 1, H9)

- ``hub_tokens``: one token per (tenant, hub: ``hf`` | ``modelscope``); tenant "" is the
  platform's own, for tenants without one. The token is sealed (AES-GCM under a key
  derived from the platform secret, the row id as associated data: services/tenancy/
  hub_tokens.py); ``token_hint`` is its last characters, what a read shows. Create and
  dry run resolve a hub source with the creating tenant's token; the claim hands the
  task tenant's token to the node's agent alone.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hub_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(32), nullable=False, server_default=""),
        sa.Column("hub", sa.String(16), nullable=False),
        sa.Column("token_sealed", sa.Text(), nullable=False),
        sa.Column("token_hint", sa.String(16), nullable=False, server_default=""),
        sa.Column("created_by", sa.String(32), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "hub", name="uq_hub_token"),
    )


def downgrade() -> None:
    op.drop_table("hub_tokens")
