"""The DB side of a dispatch pass: read the fleet and the queue, claim the starts.

Reads are bounded: the queue is read as the first ``per_tenant`` jobs of each
(tier, tenant), never the whole backlog, so a pass costs O(tenants x free GPUs)
rows whatever the queue's length. The claim locks the chosen rows with
``FOR UPDATE SKIP LOCKED`` on PostgreSQL: a job a cancel is holding is skipped
for this pass rather than waited on. (SQLite ignores the clause; there the
dispatcher is the single writer its lease makes it, and writers are serialized.)
GPU allocations have the (host, GPU) primary key, so even a dispatcher with a
stale view cannot bind a GPU twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from nbfleet.db.job_tables import BinaryVersion, GpuAllocation, Job, JobAttempt, TenantUsage
from nbfleet.db.tables import Agent, Project
from nbfleet.jobs import binaries
from nbfleet.jobs.admission import gpu_groups
from nbfleet.jobs.attempts import SCHEDULED, WORKER
from nbfleet.jobs.events import transition
from nbfleet.jobs.settings import JobSettings
from nbfleet.ledger import holds
from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.jobs import PLACED, JobState
from nbfleet.model.resources import HostInventory
from nbfleet.policy.fairness import QueuedWork, Tenant, UsageLedger
from nbfleet.policy.job_dispatch import PendingJob, PlacedJob
from nbfleet.policy.job_placement import FreeGpus, Placement
from nbfleet.policy.preemption import RunningWork


@dataclass(frozen=True, slots=True)
class LiveHost:
    id: str
    url: str
    boot_id: str


@dataclass
class Fleet:
    free: FreeGpus
    hosts: dict[str, LiveHost]
    placed: list[PlacedJob]


@dataclass(frozen=True)
class StartOrder:
    """What the agent needs to run one attempt (the body of its start call)."""

    job_id: str
    attempt: int
    host: LiveHost
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StopOrder:
    job_id: str
    attempt: int
    host_url: str
    reason: str
    grace_s: float


def seconds(at: datetime) -> float:
    return at.timestamp()


def load_fleet(session: Session, now: datetime, agent_timeout_s: float) -> Fleet:
    """Live hosts with their free GPUs, and the jobs placed on them."""
    alive = now - timedelta(seconds=agent_timeout_s)
    hosts: list[Host] = []
    live: dict[str, LiveHost] = {}
    # Columns, not ORM entities, here and below: a pass reads every live host and
    # every placed job, and building (then collecting) thousands of tracked objects
    # was a large share of a pass over a big fleet.
    for agent_id, url, boot_id, inventory in session.execute(
            select(Agent.id, Agent.url, Agent.boot_id, Agent.inventory)
            .where(Agent.last_heartbeat_at >= alive)):
        hosts.append(Host.from_inventory(agent_id, HostInventory(0, 0, gpu_groups(inventory))))
        live[agent_id] = LiveHost(agent_id, url, boot_id)
    by_id = {host.id: host for host in hosts}
    held: dict[tuple[str, str], list[int]] = {}
    for host_id, index, job_id in session.execute(
            select(GpuAllocation.host_id, GpuAllocation.gpu_index, GpuAllocation.job_id)):
        if host_id in by_id:
            held.setdefault((host_id, job_id), []).append(index)
    for (host_id, job_id), indices in held.items():
        by_id[host_id].commit(job_id, indices)
    free = FreeGpus(hosts)
    placed = []
    vram = {g.gpu_type: g.vram_gb for host in hosts for g in host.gpus}
    for (job_id, tenant_id, priority, gpus, preemptible, since, on_host, bound_type,
         preempting, cancelling) in session.execute(
            select(Job.id, Job.project_id, Job.priority, Job.gpus, Job.preemptible,
                   func.coalesce(Job.started_at, Job.updated_at), Job.host_id, Job.gpu_type,
                   Job.preempt_requested, Job.cancel_requested)
            .where(Job.state.in_(list(PLACED)))):
        work = RunningWork(job_id, tenant_id, priority, gpus, preemptible, seconds(since))
        gpu_type = bound_type or ""
        placed.append(PlacedJob(work, on_host or "", gpu_type, vram.get(gpu_type, 0),
                                preempting=bool(preempting or cancelling)))
    return Fleet(free, live, placed)


def load_queue(session: Session, now: datetime, per_tenant: int) -> list[PendingJob]:
    """The first ``per_tenant`` dispatchable jobs of each (tier, tenant), FIFO."""
    rank = func.row_number().over(partition_by=(Job.priority, Job.project_id),
                                  order_by=(Job.created_at, Job.id)).label("rank")
    heads = (select(Job.id, Job.project_id, Job.priority, Job.gpus, Job.gpu_types,
                    Job.vram_gb, Job.avoid_hosts, Job.preemptible, Job.created_at, rank)
             .where(Job.state == JobState.QUEUED,
                    or_(Job.next_attempt_at.is_(None), Job.next_attempt_at <= now))
             .subquery())
    rows = session.execute(select(heads).where(heads.c.rank <= per_tenant)).all()
    return [PendingJob(QueuedWork(r.id, r.project_id, r.priority, r.gpus,
                                  seconds(r.created_at), r.preemptible),
                       ResourceSpec(gpus=r.gpus, vram_gb=r.vram_gb,
                                    gpu_types=tuple(r.gpu_types)),
                       tuple(r.avoid_hosts))
            for r in rows]


def load_tenants(session: Session, tenant_ids: set[str]) -> dict[str, Tenant]:
    rows = session.execute(
        select(Project.id, Project.job_weight, Project.job_guarantee_gpus,
               Project.job_max_running).where(Project.id.in_(sorted(tenant_ids))))
    return {r.id: Tenant(r.id, r.job_weight, r.job_guarantee_gpus, r.job_max_running)
            for r in rows}


def load_usage(session: Session, tenant_ids: set[str], half_life_s: float) -> UsageLedger:
    rows = session.execute(select(TenantUsage).where(
        TenantUsage.tenant_id.in_(sorted(tenant_ids)))).scalars()
    return UsageLedger.of(half_life_s, {r.tenant_id: (r.gpu_seconds, seconds(r.at))
                                        for r in rows})


def claim(session: Session, starts: Sequence[tuple[PendingJob, Placement]], fleet: Fleet,
          settings: JobSettings, now: datetime,
          check_lease: Callable[[Session], None]) -> list[StartOrder]:
    """Turn planned starts into scheduled attempts with their GPUs bound, in the
    caller's transaction. Jobs changed or locked since the plan are skipped."""
    if not starts:
        return []
    check_lease(session)
    planned = {job.work.id: placement for job, placement in starts}
    jobs = list(session.execute(
        select(Job).where(Job.id.in_(sorted(planned)), Job.state == JobState.QUEUED)
        .order_by(Job.id).with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)).scalars())
    rollout = binaries.states_of(session, {job.binary for job in jobs})
    for job in jobs:
        binaries.leave_rolled_back(session, job, rollout[job.binary], now)
    commands = _commands(session, {(job.binary, job.version) for job in jobs})
    orders: list[StartOrder] = []
    prices: dict[str, tuple[str, int]] = {}
    for job in jobs:
        placement = planned[job.id]
        host = fleet.hosts[placement.host_id]
        command = commands.get((job.binary, job.version))
        if command is None or job.hold_id is None:
            continue  # a registry or ledger inconsistency: leave it queued, visible
        job.attempt += 1
        job.host_id, job.gpu_type = host.id, placement.gpu_type
        job.next_attempt_at = None
        rate = settings.prices.rate(placement.gpu_type)
        prices[job.hold_id] = (placement.gpu_type, rate)
        session.add(JobAttempt(
            job_id=job.id, attempt=job.attempt, host_id=host.id, host_boot_id=host.boot_id,
            gpu_type=placement.gpu_type, gpu_indices=list(placement.indices),
            rate_per_gpu_hour=rate, hold_id=job.hold_id, binary_version=job.version,
            state=SCHEDULED, gpu_ms=0, seq=0, log_chunks=0, created_at=now,
            last_heartbeat_at=now))
        session.add_all([GpuAllocation(host_id=host.id, gpu_index=index, job_id=job.id,
                                       attempt=job.attempt) for index in placement.indices])
        transition(session, job, JobState.SCHEDULED, now,
                   f"attempt {job.attempt} on {host.id} ({placement.gpu_type} "
                   f"{list(placement.indices)})")
        orders.append(_order(job, job.attempt, placement.indices, placement.gpu_type, host,
                             command, settings))
    holds.reprice(session, prices, WORKER, now)
    return orders


def _order(job: Job, attempt: int, indices: Sequence[int], gpu_type: str, host: LiveHost,
           command: list[str], settings: JobSettings) -> StartOrder:
    return StartOrder(job.id, attempt, host, {
        "job_id": job.id, "attempt": attempt, "command": command, "args": job.args,
        "gpu_indices": list(indices), "gpu_type": gpu_type, "timeout_s": job.timeout_s,
        "idle_timeout_s": job.idle_timeout_s, "memory_mb": job.memory_mb,
        "kill_grace_s": settings.kill_grace_s, "blob_prefix": f"jobs/{job.id}/{attempt}"})


def resend_orders(session: Session, settings: JobSettings, now: datetime, after_s: float,
                  agent_timeout_s: float, limit: int = 100) -> list[StartOrder]:
    """Start orders for attempts scheduled but never confirmed: a dispatcher that
    crashed between its claim and its call to the agent left them. The agent's
    start is idempotent, so sending one twice is harmless. Only those attempts'
    hosts are read (and only if they are alive), not the whole fleet."""
    cutoff = now - timedelta(seconds=after_s)
    rows = session.execute(
        select(Job, JobAttempt).join(JobAttempt, (JobAttempt.job_id == Job.id)
                                     & (JobAttempt.attempt == Job.attempt))
        .where(JobAttempt.state == SCHEDULED, JobAttempt.created_at < cutoff)
        .limit(limit)).all()
    if not rows:
        return []
    alive = now - timedelta(seconds=agent_timeout_s)
    hosts = {agent_id: LiveHost(agent_id, url, boot_id) for agent_id, url, boot_id in
             session.execute(select(Agent.id, Agent.url, Agent.boot_id).where(
                 Agent.id.in_(sorted({attempt.host_id for _job, attempt in rows})),
                 Agent.last_heartbeat_at >= alive))}
    commands = _commands(session, {(job.binary, attempt.binary_version) for job, attempt in rows})
    orders = []
    for job, attempt in rows:
        host = hosts.get(attempt.host_id)
        command = commands.get((job.binary, attempt.binary_version))
        if host is not None and host.boot_id == attempt.host_boot_id and command is not None:
            orders.append(_order(job, attempt.attempt, attempt.gpu_indices, attempt.gpu_type,
                                 host, command, settings))
    return orders


def _commands(session: Session, keys: set[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    if not keys:
        return {}
    rows = session.execute(select(BinaryVersion.name, BinaryVersion.version,
                                  BinaryVersion.command)
                           .where(BinaryVersion.name.in_(sorted({n for n, _ in keys}))))
    return {(r.name, r.version): list(r.command) for r in rows if (r.name, r.version) in keys}


def request_preemption(session: Session, victims: Sequence[PlacedJob], for_job: str,
                       fleet: Fleet, settings: JobSettings, now: datetime,
                       check_lease: Callable[[Session], None]) -> list[StopOrder]:
    """Ask running victims to stop (grace period, then kill); they requeue when
    their agent reports them ended."""
    check_lease(session)
    rows = session.execute(
        select(Job).where(Job.id.in_(sorted(v.work.id for v in victims)))
        .order_by(Job.id).with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)).scalars()
    orders = []
    for job in rows:
        if job.state not in PLACED or job.preempt_requested or job.cancel_requested \
                or not job.preemptible or job.host_id not in fleet.hosts:
            continue
        job.preempt_requested = True
        transition(session, job, JobState(job.state), now, f"preempted for {for_job}")
        orders.append(StopOrder(job.id, job.attempt, fleet.hosts[job.host_id].url,
                                "preempt", settings.kill_grace_s))
    return orders
