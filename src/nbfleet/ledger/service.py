"""The ledger's transactions, for callers that do not have one open already.

Each function here is one or a few short DB transactions around the session-level
functions, with the DB clock as ``now``. Admission code that must reserve and
enqueue in one transaction calls ``holds.reserve`` itself instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.engine import Database
from nbfleet.ledger import audit, grants, holds, metering
from nbfleet.ledger.metering import NEEDS_EXTENSION, UsageOutcome, UsageReport
from nbfleet.web.metrics import CREDIT_DECISIONS


def reserve(db: Database, request: holds.HoldRequest,
            actor: audit.Actor) -> tuple[CreditHold, bool]:
    with db.transaction() as session:
        hold, created = holds.reserve(session, request, actor, db.now(session))
    CREDIT_DECISIONS.labels("reserve", "created" if created else "replayed").inc()
    return hold, created


def meter(db: Database, reports: Sequence[UsageReport],
          actor: audit.Actor) -> list[UsageOutcome]:
    """Apply a batch of usage reports; the outcomes come back in the reports' order."""
    with db.transaction() as session:
        outcomes = metering.report_batch(session, reports, actor, db.now(session))
    for index, outcome in enumerate(outcomes):
        if outcome.status == NEEDS_EXTENSION:
            with db.transaction() as session:
                outcomes[index] = metering.report_with_extension(
                    session, reports[index], actor, db.now(session))
    for outcome in outcomes:
        CREDIT_DECISIONS.labels("usage", outcome.status).inc()
    return outcomes


def settle(db: Database, hold_id: str, reason: str, actor: audit.Actor,
           final: UsageReport | None = None) -> tuple[CreditHold, bool]:
    """Capture the final usage (if given), then release the rest, exactly once."""
    if final is not None:
        meter(db, [final], actor)
    with db.transaction() as session:
        hold, changed = holds.settle(session, hold_id, reason, actor, db.now(session))
    CREDIT_DECISIONS.labels("settle", "settled" if changed else "replayed").inc()
    return hold, changed


def reap(db: Database, limit: int = 100) -> list[str]:
    """Settle lapsed holds, each in its own transaction (see ``holds.reap``)."""
    with db.transaction(write=False) as session:
        candidates = holds.lapsed(session, db.now(session), limit)
    reaped = []
    for hold_id in candidates:
        with db.transaction() as session:
            if holds.reap_one(session, hold_id, db.now(session)):
                reaped.append(hold_id)
    CREDIT_DECISIONS.labels("reap", "settled").inc(len(reaped))
    return reaped


def expire(db: Database, limit: int = 500) -> int:
    with db.transaction() as session:
        return grants.expire_due(session, db.now(session), limit=limit)
