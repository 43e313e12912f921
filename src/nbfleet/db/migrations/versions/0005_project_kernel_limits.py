"""per-project kernel limits (memory, CPU, processes, disk) and network mode

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.add_column(sa.Column('kernel_limits', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('kernel_network', sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.drop_column('kernel_network')
        batch.drop_column('kernel_limits')
