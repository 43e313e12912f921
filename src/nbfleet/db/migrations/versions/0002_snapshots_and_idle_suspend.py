"""workspace snapshots, restore reports and per-project idle suspend

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workspaces') as batch:
        batch.add_column(sa.Column('snapshot', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('restore', sa.JSON(), nullable=True))
    with op.batch_alter_table('projects') as batch:
        batch.add_column(sa.Column('idle_suspend_s', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.drop_column('idle_suspend_s')
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_column('restore')
        batch.drop_column('snapshot')
