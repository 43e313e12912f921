"""standby replicas: standby_replicas; workspaces.placed_generation

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from nbfleet.db.types import UTCDateTime

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workspaces') as batch:
        batch.add_column(sa.Column('placed_generation', sa.Integer(), nullable=True))
    op.create_table(
        'standby_replicas',
        sa.Column('workspace_id', sa.String(length=40), nullable=False),
        sa.Column('host_id', sa.String(length=40), nullable=False),
        sa.Column('boot_id', sa.String(length=40), nullable=False),
        sa.Column('staged', sa.JSON(), nullable=True),
        sa.Column('synced_at', UTCDateTime(timezone=True), nullable=True),
        sa.Column('created_at', UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['workspace_id'], ['workspaces.id']),
        sa.PrimaryKeyConstraint('workspace_id', 'host_id'),
    )


def downgrade() -> None:
    op.drop_table('standby_replicas')
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_column('placed_generation')
