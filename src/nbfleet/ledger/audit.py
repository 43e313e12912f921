"""The credit audit trail: one immutable row per credit decision."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from nbfleet.db.bulk import append_rows
from nbfleet.db.credit_tables import CreditAudit


@dataclass(frozen=True, slots=True)
class Actor:
    """Who asked, and under which request, so every decision can be traced back."""

    actor: str
    request_id: str | None = None
    idempotency_key: str | None = None


SYSTEM_REAPER = Actor("system:reaper")
SYSTEM_EXPIRY = Actor("system:expiry")


@dataclass(slots=True)
class AuditRow:
    action: str
    subject_id: str
    org_id: str
    project_id: str | None
    wallet_id: str | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None


def record(session: Session, actor: Actor, now: datetime, rows: list[AuditRow]) -> None:
    """Append the rows in one statement (the metering path writes many at once)."""
    record_each(session, now, [(actor, row) for row in rows])


def record_each(session: Session, now: datetime, rows: list[tuple[Actor, AuditRow]]) -> None:
    """Append rows of several actors in one statement (a batch of admissions)."""
    if not rows:
        return
    append_rows(session, CreditAudit.__table__, [  # type: ignore[arg-type]
        {"org_id": row.org_id, "project_id": row.project_id, "wallet_id": row.wallet_id,
         "actor": actor.actor, "request_id": actor.request_id,
         "idempotency_key": actor.idempotency_key, "action": row.action,
         "subject_id": row.subject_id, "before": row.before, "after": row.after,
         "created_at": now}
        for actor, row in rows
    ])
