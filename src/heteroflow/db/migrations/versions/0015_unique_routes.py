"""one route per (tenant, model name, group), held by the database (issue 26)

Every name the API keeps unique is unique in the database, so that of two writes of one
name at the same moment one commits and the other answers 409 (services/unique.py).
Tenant names, user names, sharing-group names and endpoint names per tenant (with the
endpoint keys) were unique from 0001 / 0004; this adds the last one:

- ``uq_route_tenant_model_group``: a unique index on ``model_routes (tenant_id,
  model_name, group_id)`` — a tenant routes a model name to a group once (a second
  route of that name to another group is a canary and stays allowed). Task groups
  have no unique name: ``name`` is a display name, and a service's unique name is its
  endpoint's (the create takes it from ``name``).

**Existing duplicates.** The API refused a second such route before (a read under the
group's row lock), but a database written by an older build may hold some. They route
the same model name to the same group, so one is kept per (tenant, model name, group):
the group's own route (``added`` false) before an added one, then the oldest, then the
smallest id; the others are deleted (nothing refers to a route's id). A downgrade drops
the index and does not bring the deleted duplicates back.

Revision ID: 0015
Revises: 0014
Create Date: 2027-01-20 10:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

INDEX = "uq_route_tenant_model_group"
COLUMNS = ["tenant_id", "model_name", "group_id"]

# a route is dropped when another of its (tenant, model name, group) comes first:
# own before added, then older, then the smaller id
DROP_DUPLICATES = """
DELETE FROM model_routes WHERE id IN (
  SELECT r.id FROM model_routes r JOIN model_routes k
    ON k.tenant_id = r.tenant_id AND k.model_name = r.model_name
   AND k.group_id = r.group_id AND k.id <> r.id
  WHERE k.added < r.added
     OR (k.added = r.added AND (k.created_at < r.created_at
         OR (k.created_at = r.created_at AND k.id < r.id)))
)
"""


def upgrade() -> None:
    op.execute(DROP_DUPLICATES)
    op.create_index(INDEX, "model_routes", COLUMNS, unique=True)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="model_routes")
