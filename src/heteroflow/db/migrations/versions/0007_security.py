"""security: audit log, login throttle, token revocation, priority classes, volume rules

- ``audit_log``: one row per management write (issue 10, item 9).
- ``login_throttle``: failed logins per user and per address, shared by every server.
- ``users.tokens_valid_after``: tokens issued earlier are refused (password reset).
- ``task_groups.priority_class`` / ``tasks.priority_class``: "tenant" (a member's
  priority ranks only within its sharing key) or "platform" (an operator's: may preempt
  across tenants). Existing rows are "tenant".
- ``nodes.allowed_volume_prefixes`` / ``denied_volume_prefixes``: the agent's C4 rules,
  reported in the heartbeat so create can refuse a model path no node allows.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 17:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("user_id", sa.String(32), nullable=False, server_default=""),
        sa.Column("username", sa.String(128), nullable=False, server_default=""),
        sa.Column("tenant_id", sa.String(32), nullable=False, server_default=""),
        sa.Column("role", sa.String(16), nullable=False, server_default=""),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("remote_addr", sa.String(64), nullable=False, server_default=""),
        sa.Column("detail", sa.Text(), nullable=False, server_default=""),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_index("ix_audit_tenant_time", "audit_log", ["tenant_id", "created_at"])
    op.create_table(
        "login_throttle",
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("failures", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("blocked_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("users", schema=None) as b:
        b.add_column(sa.Column("tokens_valid_after", sa.DateTime(timezone=True), nullable=True))
    for table in ("task_groups", "tasks"):
        with op.batch_alter_table(table, schema=None) as b:
            b.add_column(
                sa.Column(
                    "priority_class", sa.String(16), nullable=False, server_default="tenant"
                )
            )
    with op.batch_alter_table("nodes", schema=None) as b:
        b.add_column(
            sa.Column("allowed_volume_prefixes", sa.JSON(), nullable=False, server_default="[]")
        )
        b.add_column(
            sa.Column("denied_volume_prefixes", sa.JSON(), nullable=False, server_default="[]")
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as b:
        b.drop_column("denied_volume_prefixes")
        b.drop_column("allowed_volume_prefixes")
    for table in ("tasks", "task_groups"):
        with op.batch_alter_table(table, schema=None) as b:
            b.drop_column("priority_class")
    with op.batch_alter_table("users", schema=None) as b:
        b.drop_column("tokens_valid_after")
    op.drop_table("login_throttle")
    op.drop_index("ix_audit_tenant_time", table_name="audit_log")
    op.drop_index("ix_audit_log_created_at", table_name="audit_log")
    op.drop_table("audit_log")
