"""the real job (issue 28): registry credentials, volumes and preemption per task

- ``registry_credentials``: one login per (tenant, ``registry_host``: host[:port]) for
  pulling private images (H7). ``tenant_id`` "" is the platform's own (set by an
  operator, used for every tenant without one of its own). The password is kept sealed
  (encrypted with a key derived from the platform secret,
  services/tenancy/registry_credentials.py); the API, logs and events never show it.
- ``tasks.volumes``: the task's bind mounts (A2), a JSON list of
  ``{"host_path", "container_path", "read_only"}`` under the node's volume allow-list
  (read-only unless asked otherwise); a rolling update inherits them.
- ``tasks.preemptible``: whether higher-priority work may stop this task (A2, B4);
  existing tasks keep today's behaviour (preemptible).
- ``task_groups.lora_adapters``: LoRA adapters a service serves beside its base model,
  each under its own model name (a JSON list of ``{"name", "path"}``), loaded into the
  running engines at runtime; ``tasks.max_loras``: how many adapters its engine holds at
  once (0 = LoRA off; the recipe enables it only where the engine can).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "registry_credentials",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(32), nullable=False, server_default=""),
        sa.Column("registry_host", sa.String(255), nullable=False),
        sa.Column("username", sa.String(255), nullable=False),
        sa.Column("password_sealed", sa.Text(), nullable=False),
        sa.Column("created_by", sa.String(32), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "registry_host", name="uq_registry_credential"),
    )
    with op.batch_alter_table("tasks", schema=None) as b:
        b.add_column(sa.Column("volumes", sa.JSON(), nullable=False, server_default="[]"))
        b.add_column(
            sa.Column("preemptible", sa.Boolean(), nullable=False, server_default=sa.true())
        )
        b.add_column(sa.Column("max_loras", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("task_groups", schema=None) as b:
        b.add_column(sa.Column("lora_adapters", sa.JSON(), nullable=False, server_default="[]"))


def downgrade() -> None:
    with op.batch_alter_table("task_groups", schema=None) as b:
        b.drop_column("lora_adapters")
    with op.batch_alter_table("tasks", schema=None) as b:
        b.drop_column("max_loras")
        b.drop_column("preemptible")
        b.drop_column("volumes")
    op.drop_table("registry_credentials")
