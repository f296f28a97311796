"""models that come to the nodes (issue 29): copies between nodes, operator pulls/evictions

- ``nodes.peer_url``: where the node's agent serves its model cache to the other agents
  (``http(s)://address:port``, '' when it serves none), as its heartbeat reports it; a
  node that needs a model another node holds copies it from there (``fleet://`` sources,
  and a hub source some node already fetched).
- ``model_requests``: an operator's ``heteroflow models pull`` / ``evict`` for one node,
  claimed by that node's agent through its poll and answered with the outcome (pull:
  bytes so far and in all). Kept in the database so every server instance can answer
  for it, as file requests are.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as b:
        b.add_column(sa.Column("peer_url", sa.String(300), nullable=False, server_default=""))
    op.create_table(
        "model_requests",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("node_id", sa.String(32), nullable=False, index=True),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("source", sa.Text(), nullable=False, server_default=""),
        sa.Column("key", sa.String(128), nullable=False, server_default=""),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("message", sa.Text(), nullable=False, server_default=""),
        sa.Column("done_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("requested_by", sa.String(32), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_requests")
    with op.batch_alter_table("nodes", schema=None) as b:
        b.drop_column("peer_url")
