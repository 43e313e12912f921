"""Attempts: heartbeats, the end of an attempt, and what the job does next.

Every write a worker makes names its attempt. The job row's ``attempt`` is the
fencing token: a heartbeat or a finish for any other attempt, or for one that has
already ended, changes nothing and tells the worker to stop. So a worker cut off
from the control plane, declared lost and replaced, can never overwrite the
attempt that replaced it, however late it comes back.

``end`` is the one way an attempt ends, whoever noticed (the agent's finish, the
lost-worker sweep, a failed launch, a cancel of a queued job), so the ledger, the
GPUs, the rollout counters and the retry rules are applied the same way each time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from nbfleet.db.job_tables import GpuAllocation, Job, JobAttempt, QuarantinedInput, TenantUsage
from nbfleet.db.tables import Agent
from nbfleet.jobs import binaries
from nbfleet.jobs.admission import notify, reserve_attempt
from nbfleet.jobs.binaries import ROLLED_BACK
from nbfleet.jobs.events import transition
from nbfleet.jobs.settings import JobSettings
from nbfleet.ledger import audit, holds, metering
from nbfleet.model.errors import Conflict, NotFound, PaymentRequired
from nbfleet.model.jobs import (
    BLAME,
    PLACED,
    AttemptEnd,
    JobState,
    Next,
    Outcome,
    after_attempt,
    charge,
    classify,
)
from nbfleet.policy.fairness import decayed
from nbfleet.web.metrics import JOB_ATTEMPTS

SCHEDULED = "scheduled"
RUNNING = "running"
ENDED = "ended"
LIVE = (SCHEDULED, RUNNING)

WORKER = audit.Actor("system:jobs")

_SETTLE_REASON = {Outcome.SUCCEEDED: "finished", Outcome.CANCELLED: "cancelled",
                  Outcome.PREEMPTED: "preempted"}


class Stale(Conflict):
    """A write for an attempt that is no longer the job's live one."""


@dataclass(frozen=True, slots=True)
class Beat:
    job_id: str
    attempt: int
    seq: int
    gpu_ms: int
    progress: float | None = None
    log_chunks: int = 0


@dataclass(frozen=True, slots=True)
class Directive:
    job_id: str
    attempt: int
    action: str  # continue | stop
    reason: str | None = None
    grace_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt": self.attempt, "action": self.action,
                "reason": self.reason, "grace_s": self.grace_s}


@dataclass(frozen=True)
class Facts:
    """How the agent saw the process end; ``classify`` turns them into an outcome."""

    seq: int
    gpu_ms: int
    exit_code: int | None = None
    signal: int | None = None
    killed_for: str | None = None
    launch_error: str | None = None
    output_tail: str = ""
    result: list[dict[str, Any]] = field(default_factory=list)
    log_chunks: int = 0

    def outcome(self) -> Outcome:
        if self.launch_error is not None:
            return Outcome.LAUNCH_FAILED
        return classify(self.exit_code, self.signal, self.killed_for, bool(self.result),
                        self.output_tail)


def lock_jobs(session: Session, job_ids: Sequence[str]) -> dict[str, Job]:
    rows = session.execute(
        select(Job).where(Job.id.in_(sorted(set(job_ids)))).order_by(Job.id)
        .with_for_update().execution_options(populate_existing=True)).scalars()
    return {job.id: job for job in rows}


def _attempt(session: Session, job_id: str, attempt: int) -> JobAttempt | None:
    return session.execute(
        select(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.attempt == attempt)
        .with_for_update().execution_options(populate_existing=True)).scalar_one_or_none()


def directive_for(job: Job, attempt: int, settings: JobSettings) -> Directive:
    if job.attempt != attempt or job.state not in PLACED:
        return Directive(job.id, attempt, "stop", "stale", 0.0)
    if job.cancel_requested:
        return Directive(job.id, attempt, "stop", "cancel", settings.kill_grace_s)
    if job.preempt_requested:
        return Directive(job.id, attempt, "stop", "preempt", settings.kill_grace_s)
    return Directive(job.id, attempt, "continue")


def heartbeat(session: Session, host_id: str, boot_id: str, beats: Sequence[Beat],
              settings: JobSettings, now: datetime) -> list[Directive]:
    """Record a host's reports on its attempts; answer what each should do.

    Usage is metered into each attempt's hold here, from the cumulative counter.
    """
    jobs = lock_jobs(session, [beat.job_id for beat in beats])
    directives: list[Directive] = []
    usage: list[metering.UsageReport] = []
    for beat in sorted(beats, key=lambda b: (b.job_id, b.attempt)):
        job = jobs.get(beat.job_id)
        if job is None:
            directives.append(Directive(beat.job_id, beat.attempt, "stop", "stale"))
            continue
        row = _attempt(session, job.id, beat.attempt)
        directive = directive_for(job, beat.attempt, settings)
        if row is None or row.state == ENDED or row.host_id != host_id \
                or row.host_boot_id != boot_id:
            directive = Directive(job.id, beat.attempt, "stop", "stale")
        directives.append(directive)
        if directive.reason == "stale" or row is None or beat.seq <= row.seq:
            continue
        row.seq, row.gpu_ms = beat.seq, max(row.gpu_ms, beat.gpu_ms)
        row.progress, row.log_chunks = beat.progress, max(row.log_chunks, beat.log_chunks)
        row.last_heartbeat_at = now
        if row.state == SCHEDULED:
            mark_running(session, job, row, now)
        usage.append(metering.UsageReport(row.hold_id, beat.seq, beat.gpu_ms))
    if usage:
        for outcome, report in zip(metering.report_batch(session, usage, WORKER, now), usage,
                                   strict=True):
            if outcome.status == metering.NEEDS_EXTENSION:
                metering.report_with_extension(session, report, WORKER, now)
    return directives


def mark_running(session: Session, job: Job, row: JobAttempt, now: datetime) -> None:
    row.state = RUNNING
    row.started_at = row.started_at or now
    job.started_at = job.started_at or now
    if job.state == JobState.SCHEDULED:
        transition(session, job, JobState.RUNNING, now)


def started(session: Session, job_id: str, attempt: int, now: datetime) -> bool:
    """The agent confirmed the process is running (the dispatcher's start call)."""
    job = lock_jobs(session, [job_id]).get(job_id)
    row = _attempt(session, job_id, attempt)
    if job is None or row is None or job.attempt != attempt or row.state != SCHEDULED:
        return False
    row.last_heartbeat_at = now
    mark_running(session, job, row, now)
    return True


def finish(session: Session, job_id: str, attempt: int, host_id: str, boot_id: str,
           facts: Facts, settings: JobSettings, now: datetime, jitter: float) -> Job:
    """An agent's report that an attempt's process ended. Raises ``Stale`` for an
    attempt that is not the job's live one on that host (nothing changes)."""
    job = lock_jobs(session, [job_id]).get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    row = _attempt(session, job_id, attempt)
    if row is None or row.state == ENDED or job.attempt != attempt or row.host_id != host_id \
            or row.host_boot_id != boot_id:
        raise Stale(f"attempt {attempt} of {job_id} is not live on this host", stale=True)
    end(session, job, row, facts.outcome(), settings, now, jitter, facts=facts)
    return job


def end(session: Session, job: Job, row: JobAttempt, outcome: Outcome, settings: JobSettings,
        now: datetime, jitter: float, *, facts: Facts | None = None,
        detail: str | None = None) -> None:
    """End the live attempt ``row`` of the locked ``job`` and move the job on."""
    row.state = ENDED
    row.outcome = outcome
    row.ended_at = now
    if facts is not None:
        row.exit_code, row.signal = facts.exit_code, facts.signal
        row.gpu_ms = max(row.gpu_ms, facts.gpu_ms)
        row.seq = max(row.seq, facts.seq)
        row.log_chunks = max(row.log_chunks, facts.log_chunks)
        detail = detail or facts.launch_error or (facts.output_tail[-500:] or None)
    row.detail = detail
    session.execute(delete(GpuAllocation).where(GpuAllocation.job_id == job.id,
                                                GpuAllocation.attempt == row.attempt))
    JOB_ATTEMPTS.labels(outcome).inc()
    # Whose each attempt is depends on its version's rollout state now: a canary's
    # failure is the platform's until the canary is promoted, for good once it is
    # rolled back (``model.jobs.charge``).
    rollout = binaries.states(session, job.binary)
    stable = binaries.stable_version(rollout)
    history = [_history(r, job.pinned, rollout, stable is not None) for r in session.execute(
        select(JobAttempt).where(JobAttempt.job_id == job.id, JobAttempt.state == ENDED)
        .order_by(JobAttempt.attempt)).scalars()]
    verdict = after_attempt(history, job.max_attempts, cancel_requested=job.cancel_requested,
                            rules=settings.retry, jitter=jitter)
    # The ledger first (this hold, then the next attempt's), then the binary's
    # counters, then the tenant's usage: the lock order of ``nbfleet.jobs``.
    _settle(session, row, outcome, now)
    job.host_id = job.gpu_type = None
    job.preempt_requested = False
    if verdict.next == Next.DONE:
        if verdict.state == JobState.SUCCEEDED and facts is not None:
            job.result = facts.result
        if verdict.quarantined:
            quarantine(session, job, verdict.reason, now)
        finish_job(session, job, verdict.state, verdict.reason, settings, now)
    else:
        if verdict.next == Next.RETRY and row.host_id not in job.avoid_hosts:
            job.avoid_hosts = [*job.avoid_hosts, row.host_id]
        job.next_attempt_at = now + timedelta(seconds=verdict.delay_s) if verdict.delay_s \
            else None
        reason = f"attempt {row.attempt}: {verdict.reason}"
        # An unpinned job never runs a rolled-back version again, whatever ended
        # its attempt (a preemption, a lost host); and a canary's failure falls
        # back to stable.
        if stable is not None and stable != job.version and not job.pinned and (
                verdict.next == Next.FALL_BACK or rollout.get(job.version) == ROLLED_BACK):
            reason += f" ({job.binary} {job.version} -> {stable})"
            binaries.move_to(job, stable, now)
        requeue(session, job, reason, settings, now)
    binaries.record_attempt(session, job.binary, row.binary_version, BLAME[outcome], now)
    _charge_tenant(session, job.project_id, row.gpu_ms / 1000.0, settings, now)
    notify(session)


def _history(row: JobAttempt, pinned: bool, rollout: dict[str, str],
             has_stable: bool) -> AttemptEnd:
    outcome = Outcome(str(row.outcome))
    return AttemptEnd(outcome, row.host_id,
                      charge(outcome, pinned, rollout.get(row.binary_version), has_stable))


def finish_job(session: Session, job: Job, state: JobState, reason: str,
               settings: JobSettings, now: datetime) -> None:
    """End the job; its blobs (result, logs) are kept for the retention period."""
    job.hold_id = None
    job.finished_at = now
    job.next_attempt_at = None
    job.result_expires_at = now + timedelta(seconds=settings.result_retention_s)
    transition(session, job, state, now, reason)


def requeue(session: Session, job: Job, reason: str, settings: JobSettings,
            now: datetime) -> None:
    """Back to the queue, with a fresh hold for the next attempt. If the credits
    for it are gone, the job fails instead of queueing unpaid."""
    try:
        with session.begin_nested():
            job.hold_id = reserve_attempt(session, job, job.attempt + 1, WORKER, now)
    except PaymentRequired as exc:
        finish_job(session, job, JobState.FAILED, f"{reason}; no retry: {exc.detail}",
                   settings, now)
        return
    transition(session, job, JobState.QUEUED, now, reason)


def _settle(session: Session, row: JobAttempt, outcome: Outcome, now: datetime) -> None:
    """Capture the attempt's final usage, then release the rest of its hold."""
    if row.gpu_ms:
        final = metering.UsageReport(row.hold_id, max(row.seq, 1) + 1, row.gpu_ms)
        (result,) = metering.report_batch(session, [final], WORKER, now, lock_buckets=True)
        if result.status == metering.NEEDS_EXTENSION:
            metering.report_with_extension(session, final, WORKER, now)
    holds.settle(session, row.hold_id, _SETTLE_REASON.get(outcome, "failed"), WORKER, now)


def _charge_tenant(session: Session, tenant_id: str, gpu_seconds: float,
                   settings: JobSettings, now: datetime) -> None:
    """Add an attempt's GPU-seconds to its tenant's decayed usage (fair share)."""
    if gpu_seconds <= 0:
        return
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(TenantUsage).values(tenant_id=tenant_id, gpu_seconds=0.0, at=now)
                    .on_conflict_do_nothing(index_elements=["tenant_id"]))
    usage = session.execute(select(TenantUsage).where(TenantUsage.tenant_id == tenant_id)
                            .with_for_update().execution_options(populate_existing=True)
                            ).scalar_one()
    elapsed = max(0.0, (now - usage.at).total_seconds())
    usage.gpu_seconds = decayed(usage.gpu_seconds, elapsed, settings.usage_half_life_s) \
        + gpu_seconds
    usage.at = max(now, usage.at)
    if not math.isfinite(usage.gpu_seconds):
        usage.gpu_seconds = 0.0


def quarantine(session: Session, job: Job, reason: str, now: datetime) -> None:
    job.quarantined = True
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(QuarantinedInput).values(
        fingerprint=job.fingerprint, binary=job.binary, version=job.version, job_id=job.id,
        reason=reason, created_at=now).on_conflict_do_nothing(index_elements=["fingerprint"]))


# ------------------------------------------------------------------- cancel

def cancel(session: Session, job: Job, settings: JobSettings, now: datetime) -> bool:
    """Cancel in any state. A queued job ends now; a placed one is asked to stop
    (the caller tells its agent) and ends when the agent reports, or when the
    lost-worker sweep gives up on it. Returns whether an agent must be told."""
    state = JobState(job.state)
    if state == JobState.CANCELLED:
        return False
    if state in (JobState.SUCCEEDED, JobState.FAILED, JobState.TIMED_OUT,
                 JobState.DEAD_LETTERED):
        raise Conflict(f"job {job.id} already ended ({state}); there is nothing to cancel",
                       state=state.value)
    job.cancel_requested = True
    if state == JobState.QUEUED:
        if job.hold_id is not None:
            holds.settle(session, job.hold_id, "cancelled", WORKER, now)
        finish_job(session, job, JobState.CANCELLED, "cancelled while queued", settings, now)
        return False
    transition(session, job, state, now, "cancel requested")
    return True


# ------------------------------------------------------------ lost workers

def silent_attempts(session: Session, now: datetime, timeout_s: float,
                    limit: int = 200) -> list[tuple[str, int]]:
    """Live attempts not heard from for ``timeout_s``: their host died or is cut off."""
    cutoff = now - timedelta(seconds=timeout_s)
    rows = session.execute(
        select(JobAttempt.job_id, JobAttempt.attempt)
        .where(JobAttempt.state.in_(LIVE), JobAttempt.last_heartbeat_at < cutoff)
        .order_by(JobAttempt.last_heartbeat_at).limit(limit)).all()
    return [(job_id, attempt) for job_id, attempt in rows]


def attempts_on_old_boots(session: Session, limit: int = 200) -> list[tuple[str, int]]:
    """Live attempts whose host has restarted since: they went with the old boot."""
    rows = session.execute(
        select(JobAttempt.job_id, JobAttempt.attempt)
        .join(Agent, Agent.id == JobAttempt.host_id)
        .where(JobAttempt.state.in_(LIVE), JobAttempt.host_boot_id != Agent.boot_id)
        .limit(limit)).all()
    return [(job_id, attempt) for job_id, attempt in rows]


def end_if_live(session: Session, job_id: str, attempt: int, outcome: Outcome, detail: str,
                settings: JobSettings, now: datetime, jitter: float,
                older_than: datetime | None = None) -> bool:
    """End an attempt from the control plane's side (lost, launch failed), if it is
    still the job's live one and, with ``older_than``, still silent."""
    job = lock_jobs(session, [job_id]).get(job_id)
    row = _attempt(session, job_id, attempt)
    if job is None or row is None or row.state == ENDED or job.attempt != attempt:
        return False
    if older_than is not None and row.last_heartbeat_at >= older_than:
        return False
    if job.cancel_requested:
        outcome = Outcome.CANCELLED
    end(session, job, row, outcome, settings, now, jitter, detail=detail)
    return True
