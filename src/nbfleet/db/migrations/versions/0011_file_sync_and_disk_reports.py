"""what hosts report of their files and disk: workspaces.files_unsynced_since,
agents.files_lag_s, agents.disk_short

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 03:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from nbfleet.db.types import UTCDateTime

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workspaces') as batch:
        batch.add_column(sa.Column('files_unsynced_since', UTCDateTime(timezone=True),
                                   nullable=True))
    with op.batch_alter_table('agents') as batch:
        batch.add_column(sa.Column('files_lag_s', sa.Float(), nullable=False,
                                   server_default='0'))
        batch.add_column(sa.Column('disk_short', sa.Boolean(), nullable=False,
                                   server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('agents') as batch:
        batch.drop_column('disk_short')
        batch.drop_column('files_lag_s')
    with op.batch_alter_table('workspaces') as batch:
        batch.drop_column('files_unsynced_since')
