"""workspace resource requests, each project's default request, GPU placements and moves

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workspaces') as batch:
        batch.add_column(sa.Column('resources', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('gpu_placement', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('move_to', sa.String(length=40), nullable=True))
    with op.batch_alter_table('projects') as batch:
        batch.add_column(sa.Column('default_resources', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.drop_column('default_resources')
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_column('move_to')
        batch.drop_column('gpu_placement')
        batch.drop_column('resources')
