"""Admission: quotas, the quarantine, the binary, a ledger hold and the queue row,
all in the caller's one transaction. Either the job is queued with credit held
for it, or nothing happened."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from nbfleet.db.ids import new_id
from nbfleet.db.job_tables import Job, QuarantinedInput
from nbfleet.db.tables import Agent, Project
from nbfleet.jobs import binaries
from nbfleet.jobs.events import submitted
from nbfleet.jobs.settings import JobSettings
from nbfleet.ledger import audit, holds
from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.errors import DomainError, InvalidInput, NotFound
from nbfleet.model.jobs import JobState, Scalar, check_args, input_fingerprint
from nbfleet.model.pricing import hold_amount
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.policy.gpu_fit import choose_gpus

#: The PostgreSQL channel the dispatcher listens on.
CHANNEL = "nbfleet_jobs"
#: Holds outlive any queue wait and run; the job watchdog settles them first.
HOLD_LEASE_S = holds.MAX_LEASE_S
DEFAULT_IDLE_TIMEOUT_S = 300


class QuotaExceeded(DomainError):
    status = 429
    title = "Too many requests"


@dataclass(frozen=True, slots=True)
class Tenant:
    org_id: str
    project_id: str
    user_id: str


@dataclass(frozen=True)
class JobRequest:
    binary: str
    args: dict[str, Scalar] = field(default_factory=dict)
    version: str | None = None
    gpus: int = 1
    gpu_types: tuple[str, ...] = ()
    vram_gb: int = 0
    memory_mb: int | None = None
    timeout_s: int = 3600
    #: None: 300 s, or the timeout if that is shorter.
    idle_timeout_s: int | None = None
    max_attempts: int = 3
    tier: str = "free"
    preemptible: bool = False
    name: str | None = None


def _check(request: JobRequest, settings: JobSettings) -> None:
    if not 1 <= request.gpus <= settings.max_gpus:
        raise InvalidInput(f"gpus must be between 1 and {settings.max_gpus}", field="gpus")
    if not 1 <= request.timeout_s <= settings.max_timeout_s:
        raise InvalidInput(f"timeout_s must be between 1 and {settings.max_timeout_s}",
                           field="timeout_s")
    if request.idle_timeout_s is not None and not 1 <= request.idle_timeout_s <= request.timeout_s:
        raise InvalidInput("idle_timeout_s must be between 1 and timeout_s",
                           field="idle_timeout_s")
    if not 1 <= request.max_attempts <= 20:
        raise InvalidInput("max_attempts must be between 1 and 20", field="max_attempts")
    if request.tier not in settings.tiers:
        raise InvalidInput(f"unknown tier {request.tier!r}; known: "
                           f"{', '.join(sorted(settings.tiers))}", field="tier")
    if request.memory_mb is not None and not 64 <= request.memory_mb <= 4 * 1024 * 1024:
        raise InvalidInput("memory_mb must be between 64 and 4194304", field="memory_mb")
    ResourceSpec(gpus=request.gpus, vram_gb=request.vram_gb, gpu_types=request.gpu_types)


Shape = tuple[GpuGroup, ...]


def gpu_groups(inventory: dict[str, Any]) -> Shape:
    """The GPU groups of an agent's registered inventory."""
    return tuple(GpuGroup(int(g["count"]), str(g["type"]), int(g["vram_gb"]))
                 for g in inventory.get("gpus", []))


def fleet_shapes(session: Session) -> list[Shape]:
    """The distinct GPU configurations of registered hosts. O(hosts): callers cache
    it for a few seconds rather than read it per submission."""
    shapes = {gpu_groups(inventory) for inventory in
              session.execute(select(Agent.inventory)).scalars()}
    # GpuGroup has no order: sort by its fields (two distinct shapes made sorted() raise).
    return sorted(shapes, key=lambda shape: [(g.gpu_type, g.vram_gb, g.count) for g in shape])


def _check_fleet_fits(fleet: list[Host], spec: ResourceSpec) -> None:
    """Refuse a job no registered host could ever run (with no hosts yet, accept:
    they may still be coming)."""
    if fleet and not any(choose_gpus(host.gpus, spec) is not None for host in fleet):
        types = sorted({g.gpu_type for host in fleet for g in host.gpus})
        raise InvalidInput(
            f"no host can run {spec.gpus} GPU(s) of type {list(spec.gpu_types) or 'any'} "
            f"with {spec.vram_gb} GB VRAM; the fleet has {types or 'no GPUs'}", field="gpus")


def _check_quota(session: Session, project: Project, tier: str) -> None:
    if project.job_tiers is not None and tier not in project.job_tiers:
        raise InvalidInput(f"tier {tier!r} is not enabled for this project; it may use "
                           f"{', '.join(project.job_tiers) or 'none'}", field="tier")
    if project.job_max_queued is None:
        return
    waiting = session.execute(
        select(func.count()).select_from(Job)
        .where(Job.project_id == project.id, Job.state == JobState.QUEUED)
    ).scalar_one()
    if waiting >= project.job_max_queued:
        raise QuotaExceeded(f"project quota: at most {project.job_max_queued} queued jobs",
                            reason="quota_exceeded", limit=project.job_max_queued)


def submit(session: Session, tenant: Tenant, request: JobRequest, settings: JobSettings,
           shapes: Sequence[Shape], actor: audit.Actor, now: datetime) -> Job:
    """Admit one job: it is queued with its first attempt's credit held, or an error
    is raised and the caller's transaction rolls back. ``shapes`` is
    ``fleet_shapes`` (perhaps cached): what kinds of host exist."""
    _check(request, settings)
    args = check_args(request.args)
    project = session.get(Project, tenant.project_id)
    if project is None:
        raise NotFound("no such project")
    _check_quota(session, project, request.tier)
    job_id = new_id("job")
    binary = binaries.resolve(session, request.binary, request.version, job_id)
    fingerprint = input_fingerprint(tenant.project_id, binary.name, binary.version, args)
    poisoned = session.get(QuarantinedInput, fingerprint)
    if poisoned is not None:
        raise InvalidInput(f"this input is quarantined: {poisoned.reason} (job "
                           f"{poisoned.job_id})", reason="quarantined", job_id=poisoned.job_id)
    spec = ResourceSpec(gpus=request.gpus, vram_gb=request.vram_gb, gpu_types=request.gpu_types)
    fleet = [Host.from_inventory(f"shape{i}", HostInventory(0, 0, shape))
             for i, shape in enumerate(shapes)]
    _check_fleet_fits(fleet, spec)
    known = sorted({g.gpu_type for host in fleet for g in host.gpus if g.satisfies(spec)})
    gpu_type, rate = settings.prices.dearest(request.gpu_types, known)
    job = Job(
        id=job_id, org_id=tenant.org_id, project_id=tenant.project_id, owner_id=tenant.user_id,
        name=request.name, binary=binary.name, version=binary.version,
        pinned=request.version is not None, args=args, gpus=request.gpus,
        gpu_types=list(request.gpu_types), vram_gb=request.vram_gb,
        memory_mb=request.memory_mb or settings.default_memory_mb,
        timeout_s=request.timeout_s,
        idle_timeout_s=request.idle_timeout_s or min(DEFAULT_IDLE_TIMEOUT_S, request.timeout_s),
        max_attempts=request.max_attempts, tier=request.tier,
        priority=settings.tiers[request.tier], preemptible=request.preemptible,
        state=JobState.QUEUED, attempt=0, hold_id=None, max_rate=rate, max_rate_type=gpu_type,
        host_id=None,
        gpu_type=None, avoid_hosts=[], next_attempt_at=None, cancel_requested=False,
        preempt_requested=False, reason=None, quarantined=False, fingerprint=fingerprint,
        result=None, result_expires_at=None, created_at=now, updated_at=now,
        started_at=None, finished_at=None)
    # The hold first, so the job row is inserted with it (one statement, not an
    # insert and an update); nothing else can see the job before the commit.
    job.hold_id = reserve_attempt(session, job, 1, actor, now)
    session.add(job)
    session.flush()
    submitted(session, job, now)
    notify(session)
    return job


def attempt_work_id(job_id: str, attempt: int) -> str:
    """Each attempt has its own hold, priced when it starts and settled when it ends."""
    return f"{job_id}#{attempt}"


def reserve_attempt(session: Session, job: Job, attempt: int, actor: audit.Actor,
                    now: datetime) -> str:
    """Hold credit for attempt ``attempt``: timeout x GPUs at the admission price."""
    hold, _created = holds.reserve(session, holds.HoldRequest(
        work_id=attempt_work_id(job.id, attempt), org_id=job.org_id,
        project_id=job.project_id, user_id=job.owner_id, gpu_type=job.max_rate_type,
        rate_per_gpu_hour=job.max_rate,
        amount=hold_amount(job.timeout_s, job.gpus, job.max_rate), lease_s=HOLD_LEASE_S),
        actor, now)
    return hold.id


def notify(session: Session) -> None:
    """Wake dispatchers listening on PostgreSQL once this transaction commits."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"NOTIFY {CHANNEL}"))
