"""One-transaction ledger steps at a chosen ``now``, and readers of the ledger's rows,
for the ledger's scenario, model and race tests."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from nbfleet.db.credit_tables import (
    CreditAudit,
    CreditBucket,
    CreditHold,
    CreditHoldPart,
    LedgerEntry,
    SpendCounter,
    Wallet,
)
from nbfleet.db.engine import Database
from nbfleet.ledger import budgets, grants, holds, metering
from nbfleet.ledger.budgets import BudgetTarget
from nbfleet.model.credits import Enforcement, Level, Period
from tests.support.ledger import ADMIN, T0, Tenant

BALANCE = ("available", "held", "consumed", "expired")
HOLD_FIELDS = ("amount", "held", "captured", "released", "expired", "uncovered", "gpu_ms",
               "last_seq", "state")


def reserve(db: Database, tenant: Tenant, work_id: str, amount: int, now: datetime = T0,
            lease_s: int = 300, user: bool = True, rate: int = 3_600_000) -> CreditHold:
    with db.transaction() as session:
        hold, _created = holds.reserve(
            session, tenant.hold_request(work_id, amount, rate=rate, lease_s=lease_s, user=user),
            ADMIN, now)
        return hold


def usage(db: Database, hold_id: str, seq: int, gpu_ms: int, now: datetime,
          reported_at: datetime | None = None) -> metering.UsageOutcome:
    """What ``service.meter`` does for one report, at ``now``."""
    report = metering.UsageReport(hold_id, seq, gpu_ms, reported_at)
    with db.transaction() as session:
        [outcome] = metering.report_batch(session, [report], ADMIN, now)
    if outcome.status == metering.NEEDS_EXTENSION:
        with db.transaction() as session:
            outcome = metering.report_with_extension(session, report, ADMIN, now)
    return outcome


def settle(db: Database, hold_id: str, reason: str, now: datetime) -> tuple[CreditHold, bool]:
    with db.transaction() as session:
        return holds.settle(session, hold_id, reason, ADMIN, now)


def reap(db: Database, now: datetime) -> list[str]:
    with db.transaction() as session:
        return holds.reap(session, now)


def expire(db: Database, now: datetime) -> int:
    with db.transaction() as session:
        return grants.expire_due(session, now)


def budget(db: Database, tenant: Tenant, level: Level, limit: int,
           enforcement: Enforcement = Enforcement.HARD, period: Period = Period.DAY,
           now: datetime = T0) -> str:
    target = BudgetTarget(level, tenant.org_id,
                          None if level is Level.ORG else tenant.project_id,
                          tenant.user_id if level is Level.USER else None)
    with db.transaction() as session:
        return budgets.create(session, target, period, limit, enforcement, ADMIN, now).id


def bucket(db: Database, bucket_id: str) -> dict[str, int]:
    with db.transaction(write=False) as session:
        row = session.get(CreditBucket, bucket_id)
        assert row is not None
        return {name: getattr(row, name) for name in BALANCE}


def hold(db: Database, hold_id: str) -> CreditHold:
    with db.transaction(write=False) as session:
        row = session.get(CreditHold, hold_id)
        assert row is not None
        return row


def hold_numbers(db: Database, hold_id: str) -> dict[str, Any]:
    row = hold(db, hold_id)
    return {name: getattr(row, name) for name in HOLD_FIELDS}


def parts(db: Database, hold_id: str) -> list[tuple[str, int, int, int]]:
    """(bucket, amount, held, captured) of a hold's parts in spend order."""
    with db.transaction(write=False) as session:
        rows = session.execute(select(CreditHoldPart).where(CreditHoldPart.hold_id == hold_id)
                               .order_by(CreditHoldPart.ordinal)).scalars()
        return [(row.bucket_id, row.amount, row.held, row.captured) for row in rows]


def audit_rows(db: Database, subject_id: str | None = None,
               action: str | None = None) -> list[tuple[str, Any, Any]]:
    """(action, before, after) of the audit rows, in order."""
    with db.transaction(write=False) as session:
        query = select(CreditAudit).order_by(CreditAudit.id)
        if subject_id is not None:
            query = query.where(CreditAudit.subject_id == subject_id)
        if action is not None:
            query = query.where(CreditAudit.action == action)
        return [(row.action, row.before, row.after) for row in session.execute(query).scalars()]


def counter(db: Database, scope: str, period: str) -> int:
    with db.transaction(write=False) as session:
        return int(session.execute(select(SpendCounter.amount).where(
            SpendCounter.scope == scope, SpendCounter.period == period)).scalar_one_or_none()
            or 0)


def row_counts(db: Database) -> dict[str, int]:
    tables = (CreditHold, CreditHoldPart, LedgerEntry, CreditAudit, CreditBucket, Wallet)
    with db.transaction(write=False) as session:
        counts = {table.__tablename__: session.execute(
            select(func.count()).select_from(table)).scalar_one() for table in tables}
        counts["spend"] = int(session.execute(
            select(func.coalesce(func.sum(SpendCounter.amount), 0))).scalar_one())
        return counts


def txns(db: Database, hold_id: str) -> list[str]:
    """The kinds of a hold's journal transactions, in order."""
    with db.transaction(write=False) as session:
        rows = session.execute(select(LedgerEntry.txn_id, LedgerEntry.kind)
                               .where(LedgerEntry.hold_id == hold_id)
                               .order_by(LedgerEntry.id)).all()
    seen: dict[str, str] = {}
    for txn_id, kind in rows:
        seen.setdefault(txn_id, kind)
    return list(seen.values())


def wallet_totals(db: Database) -> dict[str, dict[str, int]]:
    """granted and the four balances per wallet, summed over its buckets."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(
        ("granted", *BALANCE), 0))
    with db.transaction(write=False) as session:
        for row in session.execute(select(CreditBucket)).scalars():
            totals[row.wallet_id]["granted"] += row.amount
            for name in BALANCE:
                totals[row.wallet_id][name] += getattr(row, name)
    return dict(totals)


def assert_balanced(db: Database) -> None:
    """granted = available + held + consumed + expired in every wallet."""
    for wallet_id, total in wallet_totals(db).items():
        assert total["granted"] == sum(total[name] for name in BALANCE), (wallet_id, total)
        assert all(total[name] >= 0 for name in BALANCE), (wallet_id, total)
