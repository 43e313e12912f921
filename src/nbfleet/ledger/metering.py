"""Metered usage: cumulative counters captured from held into consumed.

A report carries the work's cumulative GPU-milliseconds and a sequence number.
A report whose sequence is not above the last applied one changes nothing, and
the counter only moves forward, so retried, duplicated and reordered reports are
harmless. The report's own timestamp is kept out of every decision: leases and
budget periods run on the DB clock, so a reporter's clock skew cannot matter.

Reports that fit within their holds are applied in one transaction per batch
(the hot path). A report that needs more credit than its hold has left is applied
apart, in a transaction that may take the counters' and the buckets' locks,
keeping the lock order of ``ledger.holds``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.db.bulk import update_rows
from nbfleet.db.credit_tables import CreditBucket, CreditHold, CreditHoldPart
from nbfleet.ledger import audit, holds
from nbfleet.ledger.journal import Account, Move, post_many
from nbfleet.model.credits import usage_cost
from nbfleet.model.errors import InvalidInput

APPLIED = "applied"
DUPLICATE = "duplicate"
SETTLED = "settled"
NOT_FOUND = "not_found"
EXHAUSTED = "exhausted"
NEEDS_EXTENSION = "needs_extension"


@dataclass(frozen=True, slots=True)
class UsageReport:
    hold_id: str
    seq: int
    gpu_ms: int
    #: The reporter's clock, kept for the audit trail only.
    reported_at: datetime | None = None

    def check(self) -> None:
        if self.seq < 1 or self.gpu_ms < 0 or self.gpu_ms > 10**15:
            raise InvalidInput("seq must be 1 or more and gpu_ms between 0 and 10^15",
                               hold_id=self.hold_id)


@dataclass(slots=True)
class UsageOutcome:
    hold_id: str
    status: str
    #: The hold as it stands after the report (a CreditHold or a record of its
    #: columns); rendered only when asked, off the metering path.
    record: Any = field(default=None)

    @property
    def hold(self) -> dict[str, Any] | None:
        return holds.view(self.record) if self.record is not None else None

    def as_json(self) -> dict[str, Any]:
        return {"hold_id": self.hold_id, "status": self.status, "hold": self.hold}


class _Hold(Protocol):
    """What the metering arithmetic needs of a hold: an ORM row or a plain record."""

    id: str
    org_id: str
    project_id: str
    state: str
    rate_per_gpu_hour: int
    held: int
    captured: int
    uncovered: int
    exhausted: bool
    gpu_ms: int
    last_seq: int
    lease_s: int
    lease_expires_at: datetime
    updated_at: datetime


class _Part(Protocol):
    bucket_id: str
    held: int
    captured: int


def _capture(hold: _Hold, parts: Sequence[_Part], due: int,
             wallet_of: dict[str, str]) -> list[Move]:
    """Move ``due`` from held to consumed, from the parts in spend order."""
    moves = []
    left = due
    for part in parts:
        if left <= 0:
            break
        take = min(part.held, left)
        if take:
            part.held -= take
            part.captured += take
            left -= take
            moves.append(Move(part.bucket_id, wallet_of[part.bucket_id], Account.HELD,
                              Account.CONSUMED, take))
    assert left == 0, "capture beyond the hold"
    hold.held -= due
    hold.captured += due
    return moves


def _due(hold: _Hold, gpu_ms: int) -> int:
    return usage_cost(gpu_ms, hold.rate_per_gpu_hour) - hold.captured - hold.uncovered


def _advance(hold: _Hold, report: UsageReport, now: datetime) -> None:
    """Move the counter and the sequence on, and renew the lease from the DB clock."""
    hold.gpu_ms = max(hold.gpu_ms, report.gpu_ms)
    hold.last_seq = report.seq
    hold.lease_expires_at = now + timedelta(seconds=hold.lease_s)
    hold.updated_at = now


def _skip(hold: _Hold | None, report: UsageReport) -> str | None:
    if hold is None:
        return NOT_FOUND
    if hold.state != holds.ACTIVE:
        return SETTLED
    if report.seq <= hold.last_seq:
        return DUPLICATE
    return None


def _note(hold: _Hold, before: dict[str, Any], report: UsageReport,
          wallet: str | None) -> audit.AuditRow:
    after = {**holds.snapshot(hold), "seq": report.seq,
             "reported_at": report.reported_at.isoformat() if report.reported_at else None}
    return audit.AuditRow("usage", hold.id, hold.org_id, hold.project_id, wallet, before, after)


# The batch path works on plain rows and writes them back in bulk, not through the
# ORM's unit of work: it is the ledger's hottest path (see docs/benchmarks.md).


def _locked_rows(session: Session, hold_ids: Sequence[str]) -> dict[str, SimpleNamespace]:
    rows = session.execute(
        select(CreditHold.__table__).where(CreditHold.id.in_(sorted(set(hold_ids))))
        .order_by(CreditHold.id).with_for_update()).mappings()
    return {row["id"]: SimpleNamespace(**row) for row in rows}


def _part_rows(session: Session, hold_ids: Sequence[str]
               ) -> tuple[dict[str, list[SimpleNamespace]], dict[str, str]]:
    """Each hold's parts in spend order, and each of their buckets' wallet."""
    rows = session.execute(
        select(CreditHoldPart.hold_id, CreditHoldPart.bucket_id, CreditHoldPart.held,
               CreditHoldPart.captured, CreditBucket.wallet_id)
        .join(CreditBucket, CreditBucket.id == CreditHoldPart.bucket_id)
        .where(CreditHoldPart.hold_id.in_(list(hold_ids)))
        .order_by(CreditHoldPart.hold_id, CreditHoldPart.ordinal)).all()
    grouped: dict[str, list[SimpleNamespace]] = {hold_id: [] for hold_id in hold_ids}
    wallet_of: dict[str, str] = {}
    for hold_id, bucket_id, held, captured, wallet_id in rows:
        grouped[hold_id].append(SimpleNamespace(bucket_id=bucket_id, held=held,
                                                captured=captured, changed=False))
        wallet_of[bucket_id] = wallet_id
    return grouped, wallet_of


def report_batch(session: Session, reports: Sequence[UsageReport], actor: audit.Actor,
                 now: datetime, lock_buckets: bool = False) -> list[UsageOutcome]:
    """Apply the reports that fit in their holds; mark the others NEEDS_EXTENSION.

    ``lock_buckets``: lock the applied holds' buckets up front, for a caller that
    touches them again in the same transaction (a settle after its final report).
    """
    for report in reports:
        report.check()
    locked = _locked_rows(session, [report.hold_id for report in reports])
    deferred = {report.hold_id for report in reports
                if (hold := locked.get(report.hold_id)) is not None
                and _skip(hold, report) is None
                and _due(hold, max(hold.gpu_ms, report.gpu_ms)) > hold.held}
    applied = [hold_id for hold_id in locked if hold_id not in deferred]
    parts, wallet_of = _part_rows(session, applied)
    if lock_buckets:
        holds.lock_buckets(session, list(wallet_of))
    outcomes: list[UsageOutcome] = []
    groups: list[tuple[str | None, list[Move]]] = []
    notes: list[audit.AuditRow] = []
    changed: dict[str, SimpleNamespace] = {}
    for report in reports:
        hold = locked.get(report.hold_id)
        skipped = _skip(hold, report)
        if skipped is not None or hold is None:
            outcomes.append(UsageOutcome(report.hold_id, skipped or NOT_FOUND, hold))
            continue
        if hold.id in deferred:
            outcomes.append(UsageOutcome(hold.id, NEEDS_EXTENSION))
            continue
        before = holds.snapshot(hold)
        moves = _capture(hold, parts[hold.id], _due(hold, max(hold.gpu_ms, report.gpu_ms)),
                         wallet_of)
        for move in moves:
            next(p for p in parts[hold.id] if p.bucket_id == move.bucket_id).changed = True
        _advance(hold, report, now)
        changed[hold.id] = hold
        groups.append((hold.id, moves))
        notes.append(_note(hold, before, report, moves[0].wallet_id if moves else None))
        outcomes.append(UsageOutcome(hold.id, EXHAUSTED if hold.exhausted else APPLIED,
                                     SimpleNamespace(**vars(hold))))  # as of this report
    post_many(session, "capture", groups, now)
    update_rows(session, CreditHoldPart.__table__, ("hold_id", "bucket_id"), [  # type: ignore[arg-type]
        {"hold_id": hold_id, "bucket_id": part.bucket_id, "held": part.held,
         "captured": part.captured}
        for hold_id in changed for part in parts[hold_id] if part.changed])
    update_rows(session, CreditHold.__table__, ("id",), [  # type: ignore[arg-type]
        {"id": hold.id, "held": hold.held, "captured": hold.captured, "gpu_ms": hold.gpu_ms,
         "last_seq": hold.last_seq, "lease_expires_at": hold.lease_expires_at,
         "updated_at": hold.updated_at}
        for _id, hold in sorted(changed.items())])
    audit.record(session, actor, now, notes)
    return outcomes


def report_with_extension(session: Session, report: UsageReport, actor: audit.Actor,
                          now: datetime) -> UsageOutcome:
    """Apply one report that needs more than its hold: extend the hold if budgets and
    balance allow, capture what is covered, and mark the rest uncovered (exhausted)."""
    report.check()
    hold = holds.lock(session, [report.hold_id]).get(report.hold_id)
    skipped = _skip(hold, report)
    if skipped is not None or hold is None:
        return UsageOutcome(report.hold_id, skipped or NOT_FOUND, hold)
    before = holds.snapshot(hold)
    parts = holds.parts_of(session, [hold.id])[hold.id]
    due = _due(hold, max(hold.gpu_ms, report.gpu_ms))
    if due > hold.held:
        holds.extend(session, hold, parts, due - hold.held, actor, now)
        parts = holds.parts_of(session, [hold.id])[hold.id]
    covered = min(due, hold.held)
    buckets = holds.lock_buckets(session, [part.bucket_id for part in parts])  # held already
    moves = _capture(hold, parts, covered,
                     {bucket.id: bucket.wallet_id for bucket in buckets.values()})
    hold.uncovered += due - covered
    hold.exhausted = covered < due
    _advance(hold, report, now)
    post_many(session, "capture", [(hold.id, moves)], now)
    audit.record(session, actor, now, [
        _note(hold, before, report, moves[0].wallet_id if moves else None)])
    return UsageOutcome(hold.id, EXHAUSTED if hold.exhausted else APPLIED, hold)
