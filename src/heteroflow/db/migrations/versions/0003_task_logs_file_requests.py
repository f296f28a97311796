"""task logs, file requests

New tables only: task_logs (C6), file_requests and file_request_chunks (C7). Existing
rows are untouched.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op



revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('task_logs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('task_id', sa.String(length=32), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('size_bytes', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('task_logs', schema=None) as batch_op:
        batch_op.create_index('ix_task_logs_task_seq', ['task_id', 'seq'], unique=True)

    op.create_table('file_requests',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('task_id', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.String(length=32), nullable=False),
    sa.Column('requested_by', sa.String(length=32), nullable=False),
    sa.Column('request_type', sa.String(length=16), nullable=False),
    sa.Column('target_path', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('result', sa.JSON(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('file_requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_file_requests_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_file_requests_task_id'), ['task_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_file_requests_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('file_request_chunks',
    sa.Column('request_id', sa.String(length=32), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['request_id'], ['file_requests.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('request_id', 'seq')
    )


def downgrade() -> None:
    op.drop_table('file_request_chunks')
    with op.batch_alter_table('file_requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_file_requests_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_file_requests_task_id'))
        batch_op.drop_index(batch_op.f('ix_file_requests_status'))

    op.drop_table('file_requests')
    with op.batch_alter_table('task_logs', schema=None) as batch_op:
        batch_op.drop_index('ix_task_logs_task_seq')

    op.drop_table('task_logs')
