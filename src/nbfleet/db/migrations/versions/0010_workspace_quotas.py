"""workspace quotas: projects.quota, projects.user_quota, users.quota; an index of
workspaces by owner and desired state (the per-user quota counts)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 03:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.add_column(sa.Column('quota', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('user_quota', sa.JSON(), nullable=True))
    with op.batch_alter_table('users') as batch:
        batch.add_column(sa.Column('quota', sa.JSON(), nullable=True))
    op.create_index('ix_workspaces_owner', 'workspaces', ['owner_id', 'desired_state'])


def downgrade() -> None:
    op.drop_index('ix_workspaces_owner', table_name='workspaces')
    with op.batch_alter_table('users') as batch:
        batch.drop_column('quota')
    with op.batch_alter_table('projects') as batch:
        batch.drop_column('user_quota')
        batch.drop_column('quota')
