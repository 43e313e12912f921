"""Tenants, clocks and ledger shortcuts for the credit ledger's tests."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from nbfleet.control import tenancy
from nbfleet.db.credit_tables import LedgerEntry
from nbfleet.db.engine import Database
from nbfleet.db.tables import User
from nbfleet.ledger import audit, grants, holds, verify
from nbfleet.ledger.wallets import WalletOwner, owner_by_ids
from nbfleet.model.credits import GrantKind

ADMIN = audit.Actor("usr_test_admin", request_id="req-test")
T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


@dataclass
class Tenant:
    org_id: str
    project_id: str
    user_id: str
    org: str
    project: str
    user: str

    def owner(self, db: Database, project_wallet: bool = True) -> WalletOwner:
        with db.transaction(write=False) as session:
            return owner_by_ids(session, self.org_id, self.project_id if project_wallet else None)

    def hold_request(self, work_id: str, amount: int, rate: int = 3_600_000,
                     lease_s: int = 300, user: bool = True) -> holds.HoldRequest:
        """A hold at ``rate`` micro-credits per GPU-hour: 1 micro-credit per GPU-ms."""
        return holds.HoldRequest(work_id, self.org_id, self.project_id,
                                 self.user_id if user else None, "A100-80GB", rate, amount,
                                 lease_s)


def new_tenant(db: Database, org: str | None = None, project: str = "p",
               user: str | None = None) -> Tenant:
    org = org or f"org-{uuid.uuid4().hex[:8]}"
    user = user or f"u-{uuid.uuid4().hex[:8]}"
    created = tenancy.create_user(db, user, org, project)
    with db.transaction(write=False) as session:
        row = session.execute(select(User).where(User.id == created.user_id)).scalar_one()
        return Tenant(row.org_id, row.project_id, row.id, org, project, user)


def give(db: Database, owner: WalletOwner, amount: int, now: datetime = T0,
         kind: GrantKind = GrantKind.PURCHASE, expires_at: datetime | None = None,
         priority: int = 0) -> str:
    with db.transaction() as session:
        bucket = grants.issue(session, owner, grants.GrantRequest(
            kind, amount, expires_at, priority), ADMIN, now)
        return bucket.id


def later(seconds: float, start: datetime = T0) -> datetime:
    return start + timedelta(seconds=seconds)


def entries_of(db: Database, hold_id: str) -> list[tuple[str, str, str, int]]:
    """(kind, bucket, account, amount) of a hold's journal entries, in order."""
    with db.transaction(write=False) as session:
        rows = session.execute(select(LedgerEntry).where(LedgerEntry.hold_id == hold_id)
                               .order_by(LedgerEntry.id)).scalars()
        return [(row.kind, row.bucket_id, row.account, row.amount) for row in rows]


def assert_verified(db: Database) -> verify.Report:
    report = verify.verify_db(db)  # one snapshot, however busy the ledger is
    assert report.ok, report.mismatches
    return report
