"""the browser: web sign-in sessions, Jupyter notebook sessions, JupyterLab user state

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 13:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from nbfleet.db.types import UTCDateTime

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'web_sessions',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('user_id', sa.String(length=40), nullable=False),
        sa.Column('session_hash', sa.String(length=64), nullable=False),
        sa.Column('created_at', UTCDateTime(timezone=True), nullable=False),
        sa.Column('expires_at', UTCDateTime(timezone=True), nullable=False),
        sa.Column('revoked_at', UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['user_id'], ['users.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('session_hash'),
    )
    op.create_index('ix_web_sessions_user_id', 'web_sessions', ['user_id'])
    op.create_table(
        'notebook_sessions',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('workspace_id', sa.String(length=40), nullable=False),
        sa.Column('path', sa.String(length=1024), nullable=False),
        sa.Column('name', sa.String(length=1024), nullable=False),
        sa.Column('type', sa.String(length=40), nullable=False),
        sa.Column('kernel_id', sa.String(length=40), nullable=False),
        sa.Column('created_at', UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['workspace_id'], ['workspaces.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_notebook_sessions_workspace_id', 'notebook_sessions', ['workspace_id'])
    op.create_index('ix_notebook_sessions_kernel_id', 'notebook_sessions', ['kernel_id'])
    op.create_table(
        'lab_state',
        sa.Column('user_id', sa.String(length=40), nullable=False),
        sa.Column('key', sa.String(length=300), nullable=False),
        sa.Column('value', sa.Text(), nullable=False),
        sa.Column('updated_at', UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['user_id'], ['users.id']),
        sa.PrimaryKeyConstraint('user_id', 'key'),
    )


def downgrade() -> None:
    op.drop_table('lab_state')
    op.drop_index('ix_notebook_sessions_kernel_id', 'notebook_sessions')
    op.drop_index('ix_notebook_sessions_workspace_id', 'notebook_sessions')
    op.drop_table('notebook_sessions')
    op.drop_index('ix_web_sessions_user_id', 'web_sessions')
    op.drop_table('web_sessions')
