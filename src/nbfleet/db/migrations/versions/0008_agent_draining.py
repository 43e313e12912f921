"""drained hosts: agents.draining_since and the drain's counts

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 23:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from nbfleet.db.types import UTCDateTime

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('agents') as batch:
        batch.add_column(sa.Column('draining_since', UTCDateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('drain_moved', sa.Integer(), nullable=False,
                                   server_default='0'))
        batch.add_column(sa.Column('drain_suspended', sa.Integer(), nullable=False,
                                   server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('agents') as batch:
        batch.drop_column('drain_suspended')
        batch.drop_column('drain_moved')
        batch.drop_column('draining_since')
