"""Job state changes, each with its event row: the audit trail of a job."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.orm import Session

from nbfleet.db.bulk import append_rows
from nbfleet.db.job_tables import Job, JobEvent
from nbfleet.model.jobs import JobState
from nbfleet.web.metrics import JOB_TRANSITIONS


def transition(session: Session, job: Job, to: JobState, now: datetime,
               reason: str | None = None) -> None:
    """Move ``job`` to ``to`` and record it (a no-op event-wise if nothing changes)."""
    before = job.state
    job.state = to
    job.updated_at = now
    if reason is not None:
        job.reason = reason
    session.add(JobEvent(job_id=job.id, attempt=job.attempt, from_state=before,
                         to_state=to, reason=reason, created_at=now))
    JOB_TRANSITIONS.labels(before or "new", to).inc()


def submitted(session: Session, jobs: Sequence[Job], now: datetime) -> None:
    """The first event of each job, created straight into ``queued`` (one INSERT)."""
    append_rows(session, JobEvent.__table__, [  # type: ignore[arg-type]
        {"job_id": job.id, "attempt": 0, "from_state": None, "to_state": job.state,
         "reason": "submitted", "created_at": now} for job in jobs])
    for job in jobs:
        JOB_TRANSITIONS.labels("new", job.state).inc()
