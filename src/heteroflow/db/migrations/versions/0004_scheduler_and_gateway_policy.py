"""sharing groups, booking CAS, QoS, draining, per-key limits, route tags, usage

Scheduler (#4): sharing_groups; tenants.sharing_group_id and priority_ceiling;
nodes.booking_version (placement compare-and-set); tasks.qos.
Gateway (#5): tasks.draining; per-key limits on inference_endpoints; model_routes.tags;
usage_records. Existing rows get the defaults (no sharing group, ceiling 100, no limits).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 08:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sharing_groups",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("tenants", schema=None) as b:
        b.add_column(sa.Column("sharing_group_id", sa.String(length=32), nullable=True))
        b.add_column(
            sa.Column("priority_ceiling", sa.Integer(), nullable=False, server_default="100")
        )
        b.create_foreign_key(
            "fk_tenants_sharing_group", "sharing_groups", ["sharing_group_id"], ["id"]
        )
    with op.batch_alter_table("nodes", schema=None) as b:
        b.add_column(
            sa.Column("booking_version", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("tasks", schema=None) as b:
        b.add_column(sa.Column("qos", sa.String(length=16), nullable=False, server_default=""))
        b.add_column(
            sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("inference_endpoints", schema=None) as b:
        b.add_column(sa.Column("rpm_limit", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("tpm_limit", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(
            sa.Column("quota_tokens", sa.BigInteger(), nullable=False, server_default="0")
        )
        b.add_column(
            sa.Column("quota_period", sa.String(length=16), nullable=False, server_default="")
        )
    with op.batch_alter_table("model_routes", schema=None) as b:
        b.add_column(sa.Column("tags", sa.JSON(), nullable=False, server_default="[]"))
    op.create_table(
        "usage_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("endpoint_id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("user_id", sa.String(length=32), nullable=False),
        sa.Column("model_name", sa.String(length=256), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("usage_records", schema=None) as b:
        b.create_index("ix_usage_records_endpoint_id", ["endpoint_id"], unique=False)
        b.create_index("ix_usage_tenant_time", ["tenant_id", "recorded_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as b:
        b.drop_index("ix_usage_tenant_time")
        b.drop_index("ix_usage_records_endpoint_id")
    op.drop_table("usage_records")
    with op.batch_alter_table("model_routes", schema=None) as b:
        b.drop_column("tags")
    with op.batch_alter_table("inference_endpoints", schema=None) as b:
        for c in ("quota_period", "quota_tokens", "tpm_limit", "rpm_limit"):
            b.drop_column(c)
    with op.batch_alter_table("tasks", schema=None) as b:
        b.drop_column("draining")
        b.drop_column("qos")
    with op.batch_alter_table("nodes", schema=None) as b:
        b.drop_column("booking_version")
    with op.batch_alter_table("tenants", schema=None) as b:
        b.drop_constraint("fk_tenants_sharing_group", type_="foreignkey")
        b.drop_column("priority_ceiling")
        b.drop_column("sharing_group_id")
    op.drop_table("sharing_groups")
