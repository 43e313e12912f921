"""Admission: quotas, the quarantine, the binary, a ledger hold and the queue row,
all in the caller's one transaction. Either the job is queued with credit held
for it, or nothing happened."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from nbfleet.db.bulk import append_rows
from nbfleet.db.ids import new_id
from nbfleet.db.job_tables import BinaryVersion, Job, QuarantinedInput
from nbfleet.db.queries import among
from nbfleet.db.tables import Agent, Project
from nbfleet.jobs import binaries
from nbfleet.jobs.events import submitted
from nbfleet.jobs.settings import JobSettings
from nbfleet.ledger import audit, holds
from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.errors import DomainError, InvalidInput, NotFound
from nbfleet.model.jobs import JobState, Scalar, check_args, input_fingerprint
from nbfleet.model.pricing import hold_amount
from nbfleet.model.resources import GpuGroup, HostInventory, inventory_from_json
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
    return inventory_from_json(inventory).gpus


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


def _check_tier(project: Project, tier: str) -> None:
    if project.job_tiers is not None and tier not in project.job_tiers:
        raise InvalidInput(f"tier {tier!r} is not enabled for this project; it may use "
                           f"{', '.join(project.job_tiers) or 'none'}", field="tier")


def _queued_counts(session: Session, projects: Collection[Project]) -> dict[str, int]:
    """Queued jobs of the projects that cap them (one query; none if none caps)."""
    capped = sorted(project.id for project in projects if project.job_max_queued is not None)
    if not capped:
        return {}
    counts = dict.fromkeys(capped, 0)
    for project_id, count in session.execute(
            select(Job.project_id, func.count()).where(Job.project_id.in_(capped),
                                                       Job.state == JobState.QUEUED)
            .group_by(Job.project_id)):
        counts[project_id] = count
    return counts


@dataclass(frozen=True, slots=True)
class Submission:
    """One job to admit: who submits it, what it asks for, and whom the ledger's
    audit trail names."""

    tenant: Tenant
    request: JobRequest
    actor: audit.Actor


def submit(session: Session, tenant: Tenant, request: JobRequest, settings: JobSettings,
           shapes: Sequence[Shape], actor: audit.Actor, now: datetime) -> Job:
    """Admit one job: it is queued with its first attempt's credit held, or an error
    is raised (and nothing was written for it)."""
    outcome = admit(session, [Submission(tenant, request, actor)], settings, shapes, now)[0]
    if isinstance(outcome, DomainError):
        raise outcome
    return outcome


def admit(session: Session, submissions: Sequence[Submission], settings: JobSettings,
          shapes: Sequence[Shape], now: datetime) -> list[Job | DomainError]:
    """Admit a batch of jobs in the caller's transaction, as if one after the other:
    each is queued with its first attempt's credit held, or gets the error that
    refuses it and leaves nothing behind. A few statements serve the whole batch
    (one read per kind of row, one write per table), which is what lets one
    control-plane process admit hundreds of jobs a second. ``shapes`` is
    ``fleet_shapes`` (perhaps cached): what kinds of host exist."""
    outcomes: list[Job | DomainError | None] = [None] * len(submissions)
    args: dict[int, dict[str, Scalar]] = {}
    for index, item in enumerate(submissions):
        try:
            _check(item.request, settings)
            args[index] = check_args(item.request.args)
        except DomainError as exc:
            outcomes[index] = exc
    projects = {project.id: project for project in session.execute(
        select(Project).where(among(session, Project.id, sorted(
            {submissions[index].tenant.project_id for index in args})))).scalars()}
    queued = _queued_counts(session, projects.values())
    versions = binaries.versions_of(session, {submissions[index].request.binary
                                              for index in args})
    fleet = [Host.from_inventory(f"shape{i}", HostInventory(0, 0, shape))
             for i, shape in enumerate(shapes)]
    jobs: dict[int, Job] = {}
    for index in args:
        item = submissions[index]
        try:
            jobs[index] = _new_job(item, args[index], projects.get(item.tenant.project_id),
                                   queued, versions[item.request.binary], fleet, settings, now)
        except DomainError as exc:
            outcomes[index] = exc
    fingerprints = sorted({job.fingerprint for job in jobs.values()})
    quarantined = {row.fingerprint: row for row in session.execute(
        select(QuarantinedInput).where(among(session, QuarantinedInput.fingerprint,
                                             fingerprints))).scalars()} if jobs else {}
    for index, job in list(jobs.items()):
        poisoned = quarantined.get(job.fingerprint)
        if poisoned is not None:
            outcomes[index] = InvalidInput(
                f"this input is quarantined: {poisoned.reason} (job {poisoned.job_id})",
                reason="quarantined", job_id=poisoned.job_id)
            _uncount(queued, jobs.pop(index))
    reserved = holds.reserve_many(session, [(_hold_request(job, 1), submissions[index].actor)
                                            for index, job in jobs.items()], now)
    for (index, job), hold in zip(list(jobs.items()), reserved, strict=True):
        if isinstance(hold, DomainError):
            outcomes[index] = hold
            _uncount(queued, jobs.pop(index))
        else:
            job.hold_id = hold[0].id
            outcomes[index] = job
    if jobs:
        append_rows(session, Job.__table__,  # type: ignore[arg-type]
                    [_columns(job) for job in jobs.values()])
        submitted(session, list(jobs.values()), now)
        notify(session)
    return [outcome for outcome in outcomes if outcome is not None]


def _new_job(item: Submission, args: dict[str, Scalar], project: Project | None,
             queued: dict[str, int], versions: Sequence[BinaryVersion], fleet: list[Host],
             settings: JobSettings, now: datetime) -> Job:
    """The queued row of an admissible job, or the error that refuses it. Counts it
    against its project's queue cap."""
    tenant, request = item.tenant, item.request
    if project is None:
        raise NotFound("no such project")
    _check_tier(project, request.tier)
    if project.job_max_queued is not None and queued[project.id] >= project.job_max_queued:
        raise QuotaExceeded(f"project quota: at most {project.job_max_queued} queued jobs",
                            reason="quota_exceeded", limit=project.job_max_queued)
    job_id = new_id("job")
    binary = binaries.choose(versions, request.binary, request.version, job_id)
    spec = ResourceSpec(gpus=request.gpus, vram_gb=request.vram_gb, gpu_types=request.gpu_types)
    _check_fleet_fits(fleet, spec)
    known = sorted({g.gpu_type for host in fleet for g in host.gpus if g.satisfies(spec)})
    gpu_type, rate = settings.prices.dearest(request.gpu_types, known)
    if project.job_max_queued is not None:
        queued[project.id] += 1
    return Job(
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
        host_id=None, gpu_type=None, avoid_hosts=[], next_attempt_at=None,
        cancel_requested=False, preempt_requested=False, reason=None, quarantined=False,
        fingerprint=input_fingerprint(tenant.project_id, binary.name, binary.version, args),
        result=None, result_expires_at=None, created_at=now, updated_at=now,
        started_at=None, finished_at=None)


def _uncount(queued: dict[str, int], job: Job) -> None:
    """A job refused after ``_new_job`` counted it does not take a queue slot."""
    if job.project_id in queued:
        queued[job.project_id] -= 1


_JOB_COLUMNS = [column.key for column in Job.__table__.columns]


def _columns(job: Job) -> dict[str, Any]:
    return {key: getattr(job, key) for key in _JOB_COLUMNS}


def attempt_work_id(job_id: str, attempt: int) -> str:
    """Each attempt has its own hold, priced when it starts and settled when it ends."""
    return f"{job_id}#{attempt}"


def _hold_request(job: Job, attempt: int) -> holds.HoldRequest:
    """Attempt ``attempt``'s hold: timeout x GPUs at the admission price."""
    return holds.HoldRequest(
        work_id=attempt_work_id(job.id, attempt), org_id=job.org_id,
        project_id=job.project_id, user_id=job.owner_id, gpu_type=job.max_rate_type,
        rate_per_gpu_hour=job.max_rate,
        amount=hold_amount(job.timeout_s, job.gpus, job.max_rate), lease_s=HOLD_LEASE_S)


def reserve_attempt(session: Session, job: Job, attempt: int, actor: audit.Actor,
                    now: datetime) -> str:
    """Hold credit for attempt ``attempt`` of a job already admitted."""
    hold, _created = holds.reserve(session, _hold_request(job, attempt), actor, now)
    return hold.id


def notify(session: Session) -> None:
    """Wake dispatchers listening on PostgreSQL once this transaction commits."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"NOTIFY {CHANNEL}"))
