"""Driving the job system's DB layer directly: fake hosts, submissions, dispatch
passes and agent reports, through the same functions the control plane calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from nbfleet.db.engine import Database
from nbfleet.db.job_tables import Job, JobAttempt
from nbfleet.db.tables import Agent
from nbfleet.jobs import admission, attempts, binaries, dispatch
from nbfleet.jobs.dispatch import StartOrder
from nbfleet.jobs.settings import JobSettings
from nbfleet.ledger import audit
from nbfleet.model.jobs import CanaryRule, RetryRules
from nbfleet.model.pricing import parse_prices
from nbfleet.policy.job_dispatch import plan_dispatch
from tests.support.ledger import Tenant

USER = audit.Actor("user:test")
#: 1 credit per GPU-hour by default, A100 2, H100 4 (micro-credits: x 10^6).
SETTINGS = JobSettings(prices=parse_prices("default=1,A100-80GB=2,H100-80GB=4"),
                       retry=RetryRules(backoff_base_s=0.0, backoff_cap_s=0.0))


def add_host(db: Database, host_id: str, gpus: Sequence[tuple[int, str, int]],
             boot_id: str = "boot1") -> None:
    """Register a host row as an agent would: ``gpus`` = (count, type, VRAM GB)."""
    with db.transaction() as session:
        now = db.now(session)
        session.merge(Agent(
            id=host_id, url=f"http://{host_id}.invalid", boot_id=boot_id,
            inventory={"millicpus": 8000, "memory_mb": 64000,
                       "gpus": [{"count": c, "type": t, "vram_gb": v} for c, t, v in gpus]},
            registered_at=now, last_heartbeat_at=now))


def register(db: Database, name: str = "videogen", version: str = "1.0",
             canary_percent: int = 0, rule: CanaryRule | None = None) -> None:
    with db.transaction() as session:
        binaries.register(session, name, version, ["/bin/true"], canary_percent,
                          rule or CanaryRule(), db.now(session))


def submit(db: Database, tenant: Tenant, settings: JobSettings = SETTINGS,
           **fields: object) -> Job:
    request = admission.JobRequest(**{"binary": "videogen", **fields})  # type: ignore[arg-type]
    with db.transaction() as session:
        shapes = admission.fleet_shapes(session)
        return admission.submit(session, admission.Tenant(tenant.org_id, tenant.project_id,
                                                          tenant.user_id),
                                request, settings, shapes, USER, db.now(session))


def no_lease(_session: object) -> None:
    """Tests drive passes directly, as if they held the dispatcher lease."""


@dataclass
class Pass:
    starts: list[StartOrder] = field(default_factory=list)
    stops: list[dispatch.StopOrder] = field(default_factory=list)


def dispatch_pass(db: Database, settings: JobSettings = SETTINGS) -> Pass:
    """One dispatch pass, as ``control.job_dispatcher`` runs it, minus the agent calls."""
    with db.transaction(write=False) as session:
        now = db.now(session)
        fleet = dispatch.load_fleet(session, now, 3600)
        pending = dispatch.load_queue(session, now, max(1, fleet.free.free_count()))
        if not pending:
            return Pass()
        ids = {p.work.tenant_id for p in pending} | {p.work.tenant_id for p in fleet.placed}
        tenants = dispatch.load_tenants(session, ids)
        usage = dispatch.load_usage(session, ids, settings.usage_half_life_s)
    plan = plan_dispatch(pending, fleet.free, tenants, usage, fleet.placed, now.timestamp())
    result = Pass()
    with db.transaction() as session:
        result.starts = dispatch.claim(session, plan.starts, fleet, settings, db.now(session),
                                       no_lease)
    for job, victims in plan.preemptions:
        with db.transaction() as session:
            result.stops += dispatch.request_preemption(session, victims, job.work.id, fleet,
                                                        settings, db.now(session), no_lease)
    return result


def host_of(db: Database, job_id: str) -> tuple[str, str]:
    with db.transaction(write=False) as session:
        job = session.get(Job, job_id)
        assert job is not None
        row = session.get(JobAttempt, (job_id, job.attempt))
        assert row is not None
        return row.host_id, row.host_boot_id


def beat(db: Database, job_id: str, attempt: int, seq: int, gpu_ms: int,
         settings: JobSettings = SETTINGS) -> attempts.Directive:
    host, boot = host_of(db, job_id)
    with db.transaction() as session:
        (directive,) = attempts.heartbeat(session, host, boot,
                                          [attempts.Beat(job_id, attempt, seq, gpu_ms)],
                                          settings, db.now(session))
    return directive


def finish(db: Database, job_id: str, attempt: int, facts: attempts.Facts,
           settings: JobSettings = SETTINGS, host: tuple[str, str] | None = None) -> Job:
    host_id, boot = host or host_of(db, job_id)
    with db.transaction() as session:
        return attempts.finish(session, job_id, attempt, host_id, boot, facts, settings,
                               db.now(session), 0.5)


def succeeded(gpu_ms: int, seq: int = 5) -> attempts.Facts:
    return attempts.Facts(seq=seq, gpu_ms=gpu_ms, exit_code=0, result=[
        {"name": "video.mp4", "key": "jobs/x/1/output/video.mp4", "size": 3, "sha256": "ab"}])


def crashed(gpu_ms: int = 1000, seq: int = 2) -> attempts.Facts:
    return attempts.Facts(seq=seq, gpu_ms=gpu_ms, exit_code=3)


def load(db: Database, job_id: str) -> Job:
    with db.transaction(write=False) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def attempts_of(db: Database, job_id: str) -> list[JobAttempt]:
    from sqlalchemy import select

    with db.transaction(write=False) as session:
        return list(session.execute(select(JobAttempt).where(JobAttempt.job_id == job_id)
                                    .order_by(JobAttempt.attempt)).scalars())


def age_attempts(db: Database, seconds: float) -> None:
    """Make every live attempt look silent for ``seconds`` (the DB clock is real)."""
    from sqlalchemy import update

    with db.transaction() as session:
        session.execute(update(JobAttempt).where(JobAttempt.state.in_(attempts.LIVE)).values(
            last_heartbeat_at=db.now(session) - timedelta(seconds=seconds)))
