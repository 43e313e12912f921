"""The reconciliation check: recompute every wallet from the journal and compare.

It reads only, in one transaction (one snapshot on PostgreSQL: ``verify_db``), and runs
the sums in the database, so it scales with the journal, not with Python memory.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from nbfleet.db.credit_tables import (
    CreditBucket,
    CreditHold,
    CreditHoldPart,
    LedgerEntry,
    SpendCounter,
    Wallet,
)
from nbfleet.db.engine import Database
from nbfleet.ledger.holds import scopes_of
from nbfleet.ledger.journal import Account


@dataclass
class Report:
    wallets: int = 0
    buckets: int = 0
    holds: int = 0
    entries: int = 0
    mismatches: list[str] = field(default_factory=list)
    totals: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "wallets": self.wallets, "buckets": self.buckets,
                "holds": self.holds, "entries": self.entries, "mismatches": self.mismatches,
                "totals": self.totals}


def verify_db(db: Database) -> Report:
    """Run the check in a transaction of its own: on PostgreSQL a read-only
    REPEATABLE READ one, so every query sees one snapshot of a busy ledger."""
    with db.transaction(write=False) as session:
        if not db.is_sqlite:
            session.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        return verify(session)


def verify(session: Session) -> Report:
    """The check, in the caller's transaction (a snapshot only if it is one)."""
    report = Report()
    report.entries = session.execute(select(func.count()).select_from(LedgerEntry)).scalar_one()
    for txn_id, total in session.execute(
        select(LedgerEntry.txn_id, func.sum(LedgerEntry.amount))
        .group_by(LedgerEntry.txn_id).having(func.sum(LedgerEntry.amount) != 0)
    ):
        report.mismatches.append(f"journal transaction {txn_id} does not balance: sums to {total}")

    journal: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(Account, 0))
    for bucket_id, account, total in session.execute(
        select(LedgerEntry.bucket_id, LedgerEntry.account, func.sum(LedgerEntry.amount))
        .group_by(LedgerEntry.bucket_id, LedgerEntry.account)
    ):
        journal[bucket_id][Account(account)] = int(total)

    held_by_parts = dict(session.execute(
        select(CreditHoldPart.bucket_id, func.sum(CreditHoldPart.held))
        .group_by(CreditHoldPart.bucket_id)).all())
    wallets = {wallet.id: wallet.owner for wallet in session.execute(select(Wallet)).scalars()}
    report.wallets = len(wallets)
    per_wallet: dict[str, dict[str, int]] = defaultdict(
        lambda: dict.fromkeys(("granted", "available", "held", "consumed", "expired"), 0))
    for bucket in session.execute(select(CreditBucket)).scalars():
        report.buckets += 1
        sums = journal.pop(bucket.id, dict.fromkeys(Account, 0))
        stored = {Account.GRANTED: -bucket.amount, Account.AVAILABLE: bucket.available,
                  Account.HELD: bucket.held, Account.CONSUMED: bucket.consumed,
                  Account.EXPIRED: bucket.expired}
        for account, value in stored.items():
            if sums[account] != value:
                report.mismatches.append(
                    f"bucket {bucket.id} {account}: stored {abs(value)}, journal "
                    f"{abs(sums[account])}")
        if bucket.amount != bucket.available + bucket.held + bucket.consumed + bucket.expired:
            report.mismatches.append(f"bucket {bucket.id}: granted != available + held + "
                                     "consumed + expired")
        if int(held_by_parts.get(bucket.id) or 0) != bucket.held:
            report.mismatches.append(
                f"bucket {bucket.id}: held {bucket.held}, its holds' parts hold "
                f"{int(held_by_parts.get(bucket.id) or 0)}")
        wallet_totals = per_wallet[wallets.get(bucket.wallet_id, bucket.wallet_id)]
        wallet_totals["granted"] += bucket.amount
        for name in ("available", "held", "consumed", "expired"):
            wallet_totals[name] += getattr(bucket, name)
    for bucket_id in journal:
        report.mismatches.append(f"journal entries for unknown bucket {bucket_id}")
    report.totals = dict(per_wallet)
    _check_counters(session, report, _check_holds(session, report))
    return report


def _check_holds(session: Session, report: Report) -> dict[tuple[str, str], int]:
    """Check each hold against its parts; return what the spend counters should
    hold: spent plus held per scope and period, summed over the holds."""
    parts = {hold_id: (int(held or 0), int(captured or 0)) for hold_id, held, captured in
             session.execute(select(CreditHoldPart.hold_id, func.sum(CreditHoldPart.held),
                                    func.sum(CreditHoldPart.captured))
                             .group_by(CreditHoldPart.hold_id))}
    expected: dict[tuple[str, str], int] = defaultdict(int)
    for hold in session.execute(select(CreditHold)).scalars():
        report.holds += 1
        if hold.amount != hold.held + hold.captured + hold.released + hold.expired:
            report.mismatches.append(f"hold {hold.id}: amount != held + captured + released "
                                     "+ expired")
        held, captured = parts.get(hold.id, (0, 0))
        if (held, captured) != (hold.held, hold.captured):
            report.mismatches.append(
                f"hold {hold.id}: held/captured {hold.held}/{hold.captured}, its parts "
                f"{held}/{captured}")
        if hold.state == "settled" and hold.held:
            report.mismatches.append(f"hold {hold.id}: settled but still holds {hold.held}")
        for scope in scopes_of(hold).keys().values():
            for period in (hold.day_key, hold.month_key):
                expected[(scope, period)] += hold.held + hold.captured
    return expected


def _check_counters(session: Session, report: Report,
                    expected: dict[tuple[str, str], int]) -> None:
    """Each spend counter must equal spent plus held of the holds it counts."""
    for counter in session.execute(select(SpendCounter)).scalars():
        want = expected.pop((counter.scope, counter.period), 0)
        if counter.amount != want:
            report.mismatches.append(f"spend counter {counter.scope} {counter.period}: "
                                     f"{counter.amount}, holds say {want}")
    for (scope, period), want in expected.items():
        if want:
            report.mismatches.append(f"spend counter {scope} {period} missing (holds say {want})")
