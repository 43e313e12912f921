"""credit ledger: wallets, buckets, holds, journal, budgets, spend counters, audit

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 13:25:12.196221
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import nbfleet.db.types

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('credit_audit',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('org_id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=True),
    sa.Column('wallet_id', sa.String(length=40), nullable=True),
    sa.Column('actor', sa.String(length=60), nullable=False),
    sa.Column('request_id', sa.String(length=100), nullable=True),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('action', sa.String(length=40), nullable=False),
    sa.Column('subject_id', sa.String(length=100), nullable=False),
    sa.Column('before', sa.JSON(), nullable=True),
    sa.Column('after', sa.JSON(), nullable=True),
    sa.Column('created_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('credit_audit', schema=None) as batch_op:
        batch_op.create_index('ix_credit_audit_tenant', ['org_id', 'project_id', 'created_at'], unique=False)
        batch_op.create_index('ix_credit_audit_wallet', ['wallet_id', 'created_at'], unique=False)

    op.create_table('credit_spend',
    sa.Column('scope', sa.String(length=60), nullable=False),
    sa.Column('period', sa.String(length=20), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('scope', 'period')
    )
    op.create_table('ledger_entries',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('txn_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=20), nullable=False),
    sa.Column('wallet_id', sa.String(length=40), nullable=False),
    sa.Column('bucket_id', sa.String(length=40), nullable=False),
    sa.Column('hold_id', sa.String(length=40), nullable=True),
    sa.Column('account', sa.String(length=10), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.Column('created_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.create_index('ix_ledger_entries_bucket', ['bucket_id'], unique=False)
        batch_op.create_index('ix_ledger_entries_hold', ['hold_id'], unique=False)
        batch_op.create_index('ix_ledger_entries_wallet', ['wallet_id', 'id'], unique=False)

    op.create_table('credit_holds',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('work_id', sa.String(length=100), nullable=False),
    sa.Column('org_id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=True),
    sa.Column('gpu_type', sa.String(length=40), nullable=False),
    sa.Column('rate_per_gpu_hour', sa.BigInteger(), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.Column('held', sa.BigInteger(), nullable=False),
    sa.Column('captured', sa.BigInteger(), nullable=False),
    sa.Column('released', sa.BigInteger(), nullable=False),
    sa.Column('expired', sa.BigInteger(), nullable=False),
    sa.Column('uncovered', sa.BigInteger(), nullable=False),
    sa.Column('gpu_ms', sa.BigInteger(), nullable=False),
    sa.Column('last_seq', sa.BigInteger(), nullable=False),
    sa.Column('state', sa.String(length=10), nullable=False),
    sa.Column('exhausted', sa.Boolean(), nullable=False),
    sa.Column('settle_reason', sa.String(length=20), nullable=True),
    sa.Column('settled_by', sa.String(length=60), nullable=True),
    sa.Column('lease_s', sa.Integer(), nullable=False),
    sa.Column('lease_expires_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('day_key', sa.String(length=20), nullable=False),
    sa.Column('month_key', sa.String(length=20), nullable=False),
    sa.Column('created_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('settled_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.CheckConstraint('amount = held + captured + released + expired', name='ck_credit_holds_balanced'),
    sa.CheckConstraint('held >= 0', name='ck_credit_holds_nonnegative'),
    sa.ForeignKeyConstraint(['org_id'], ['orgs.id'], ),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('work_id')
    )
    with op.batch_alter_table('credit_holds', schema=None) as batch_op:
        batch_op.create_index('ix_credit_holds_active', ['id'], unique=False, postgresql_where=sa.text("state = 'active'"), sqlite_where=sa.text("state = 'active'"))
        batch_op.create_index('ix_credit_holds_tenant', ['org_id', 'project_id', 'id'], unique=False)

    op.create_table('credit_wallets',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('owner', sa.String(length=60), nullable=False),
    sa.Column('org_id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['org_id'], ['orgs.id'], ),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('owner')
    )
    with op.batch_alter_table('credit_wallets', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_credit_wallets_org_id'), ['org_id'], unique=False)

    op.create_table('credit_buckets',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('wallet_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=10), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.Column('available', sa.BigInteger(), nullable=False),
    sa.Column('held', sa.BigInteger(), nullable=False),
    sa.Column('consumed', sa.BigInteger(), nullable=False),
    sa.Column('expired', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('memo', sa.Text(), nullable=True),
    sa.Column('created_by', sa.String(length=60), nullable=False),
    sa.Column('created_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.CheckConstraint('amount = available + held + consumed + expired', name='ck_credit_buckets_balanced'),
    sa.CheckConstraint('available >= 0 AND held >= 0 AND consumed >= 0 AND expired >= 0', name='ck_credit_buckets_nonnegative'),
    sa.ForeignKeyConstraint(['wallet_id'], ['credit_wallets.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('credit_buckets', schema=None) as batch_op:
        batch_op.create_index('ix_credit_buckets_expiry', ['expires_at'], unique=False)
        batch_op.create_index('ix_credit_buckets_wallet', ['wallet_id', 'id'], unique=False)

    op.create_table('credit_budgets',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('org_id', sa.String(length=40), nullable=False),
    sa.Column('project_id', sa.String(length=40), nullable=True),
    sa.Column('user_id', sa.String(length=40), nullable=True),
    sa.Column('level', sa.String(length=10), nullable=False),
    sa.Column('scope', sa.String(length=60), nullable=False),
    sa.Column('period', sa.String(length=10), nullable=False),
    sa.Column('limit', sa.BigInteger(), nullable=False),
    sa.Column('enforcement', sa.String(length=10), nullable=False),
    sa.Column('created_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', nbfleet.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['org_id'], ['orgs.id'], ),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('scope', 'period', 'enforcement')
    )
    with op.batch_alter_table('credit_budgets', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_credit_budgets_org_id'), ['org_id'], unique=False)

    op.create_table('credit_hold_parts',
    sa.Column('hold_id', sa.String(length=40), nullable=False),
    sa.Column('bucket_id', sa.String(length=40), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.Column('held', sa.BigInteger(), nullable=False),
    sa.Column('captured', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['bucket_id'], ['credit_buckets.id'], ),
    sa.ForeignKeyConstraint(['hold_id'], ['credit_holds.id'], ),
    sa.PrimaryKeyConstraint('hold_id', 'bucket_id')
    )
    _append_only('ledger_entries')
    _append_only('credit_audit')
    if op.get_bind().dialect.name == 'postgresql':
        # Room on each page for the metering path's updates to stay in place (HOT).
        for table in ('credit_holds', 'credit_hold_parts', 'credit_buckets'):
            op.execute(f'ALTER TABLE {table} SET (fillfactor = 70)')


def _append_only(table: str) -> None:
    """The journal and the audit trail refuse UPDATE and DELETE in the DB itself."""
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(
            "CREATE OR REPLACE FUNCTION nbfleet_append_only() RETURNS trigger AS $$ BEGIN "
            "RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END $$ LANGUAGE plpgsql")
        op.execute(f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                   "FOR EACH ROW EXECUTE FUNCTION nbfleet_append_only()")
        return
    for verb in ('UPDATE', 'DELETE'):
        op.execute(f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
                   f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END")


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        for table in ('ledger_entries', 'credit_audit'):
            op.execute(f'DROP TRIGGER IF EXISTS {table}_append_only ON {table}')
        op.execute('DROP FUNCTION IF EXISTS nbfleet_append_only()')
    op.drop_table('credit_hold_parts')
    with op.batch_alter_table('credit_budgets', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_credit_budgets_org_id'))

    op.drop_table('credit_budgets')
    with op.batch_alter_table('credit_buckets', schema=None) as batch_op:
        batch_op.drop_index('ix_credit_buckets_wallet')
        batch_op.drop_index('ix_credit_buckets_expiry')

    op.drop_table('credit_buckets')
    with op.batch_alter_table('credit_wallets', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_credit_wallets_org_id'))

    op.drop_table('credit_wallets')
    with op.batch_alter_table('credit_holds', schema=None) as batch_op:
        batch_op.drop_index('ix_credit_holds_tenant')
        batch_op.drop_index('ix_credit_holds_active')

    op.drop_table('credit_holds')
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_ledger_entries_wallet')
        batch_op.drop_index('ix_ledger_entries_hold')
        batch_op.drop_index('ix_ledger_entries_bucket')

    op.drop_table('ledger_entries')
    op.drop_table('credit_spend')
    with op.batch_alter_table('credit_audit', schema=None) as batch_op:
        batch_op.drop_index('ix_credit_audit_wallet')
        batch_op.drop_index('ix_credit_audit_tenant')

    op.drop_table('credit_audit')
