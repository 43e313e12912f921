"""One dispatch pass over the job queue: who starts where, and whom to preempt.

The pass composes the shared policies, so the live dispatcher and a simulator
decide alike:

1. ``fairness.order_queue`` orders the pending jobs: strict tiers, then weighted
   fair share on decayed usage plus what each tenant holds now, with per-tenant
   caps.
2. In that order, ``FreeGpus.place`` finds each job a host (preferred GPU types,
   best fit, avoiding hosts where it failed). A job that does not fit is passed
   over, so smaller jobs behind it may use the GPUs left (backfill).
3. A job that does not fit and outranks running preemptible work may preempt:
   per host, ``preemption.choose_victims`` picks the fewest victims that free
   enough GPUs of a type the job accepts; the host needing the fewest victims
   wins. GPUs already being freed by earlier preemptions count first, so two
   passes never preempt twice for one job. The job itself starts in a later
   pass, once the victims have stopped; being of a higher tier, it is first in line.

Pure: the caller passes the queue, the fleet and the time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nbfleet.model.cluster import ResourceSpec
from nbfleet.policy.fairness import QueuedWork, Tenant, UsageLedger, order_queue
from nbfleet.policy.job_placement import FreeGpus, Placement
from nbfleet.policy.preemption import RunningWork, choose_victims, load_by_tenant

__all__ = ["DispatchPlan", "PendingJob", "PlacedJob", "can_act", "plan_dispatch"]


@dataclass(frozen=True, slots=True)
class PendingJob:
    work: QueuedWork
    spec: ResourceSpec
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PlacedJob:
    """A job holding GPUs now: where, of which type, and whether it is already
    being preempted (its GPUs will come free)."""

    work: RunningWork
    host_id: str
    gpu_type: str
    vram_gb: int
    preempting: bool = False


@dataclass
class DispatchPlan:
    starts: list[tuple[PendingJob, Placement]] = field(default_factory=list)
    preemptions: list[tuple[PendingJob, tuple[PlacedJob, ...]]] = field(default_factory=list)


def _accepts(spec: ResourceSpec, gpu_type: str, vram_gb: int) -> bool:
    return vram_gb >= spec.vram_gb and (not spec.gpu_types or gpu_type in spec.gpu_types)


@dataclass(slots=True)
class _Incoming:
    """GPUs preempted jobs are about to free on one host (of one type), not yet
    counted for a pending job."""

    host_id: str
    gpu_type: str
    vram_gb: int
    left: int


def _avoided(job: PendingJob, free: FreeGpus) -> frozenset[str]:
    """The hosts ``FreeGpus.place`` skips for this job: those it avoids, unless only
    those could ever run it."""
    avoid = frozenset(job.avoid)
    return avoid if avoid and free.capable_hosts(job.spec) - avoid else frozenset()


class _Preemptor:
    def __init__(self, placed: Sequence[PlacedJob], tenants: Mapping[str, Tenant]) -> None:
        self.tenants = tenants
        # Summed per host and type: a job's GPUs are all on one host, so what several
        # victims free there counts together.
        incoming: dict[tuple[str, str, int], int] = {}
        for p in placed:
            if p.preempting:
                key = (p.host_id, p.gpu_type, p.vram_gb)
                incoming[key] = incoming.get(key, 0) + p.work.gpus
        self.incoming = [_Incoming(*key, left) for key, left in sorted(incoming.items())]
        self.by_host: dict[str, list[PlacedJob]] = {}
        for p in placed:
            if p.work.preemptible and not p.preempting and p.work.gpus > 0:
                self.by_host.setdefault(p.host_id, []).append(p)
        self.lowest = min((p.work.priority for hosts in self.by_host.values() for p in hosts),
                          default=math.inf)

    def claim_incoming(self, job: PendingJob, free: FreeGpus) -> bool:
        """Count GPUs already being freed towards this job, if enough are, with the
        GPUs of that host and type free now (as ``victims_for`` counted them)."""
        spec, avoided = job.spec, _avoided(job, free)
        for entry in self.incoming:
            host = free.hosts.get(entry.host_id)
            if (host is None or entry.left <= 0 or entry.host_id in avoided
                    or not _accepts(spec, entry.gpu_type, entry.vram_gb)):
                continue
            free_here = sum(1 for g in host.free_gpus()
                            if (g.gpu_type, g.vram_gb) == (entry.gpu_type, entry.vram_gb))
            if entry.left + free_here >= spec.gpus:
                entry.left -= min(entry.left, spec.gpus)
                return True
        return False

    def victims_for(self, job: PendingJob, free: FreeGpus) -> tuple[PlacedJob, ...] | None:
        if job.work.priority <= self.lowest:
            return None
        best: tuple[PlacedJob, ...] | None = None
        avoided = _avoided(job, free)
        for host_id in sorted(self.by_host):
            if host_id in avoided:  # the job would not start there
                continue
            candidates = self.by_host[host_id]
            host = free.hosts.get(host_id)
            for gpu_type, vram in sorted({(c.gpu_type, c.vram_gb) for c in candidates}):
                if not _accepts(job.spec, gpu_type, vram):
                    continue
                free_here = 0 if host is None else sum(
                    1 for g in host.free_gpus() if (g.gpu_type, g.vram_gb) == (gpu_type, vram))
                pool = [c for c in candidates if (c.gpu_type, c.vram_gb) == (gpu_type, vram)]
                chosen = choose_victims(job.work, [c.work for c in pool], self.tenants,
                                        job.spec.gpus - free_here)
                if not chosen:
                    continue
                ids = {w.id for w in chosen}
                victims = tuple(c for c in pool if c.work.id in ids)
                if best is None or (len(victims), sum(v.work.gpus for v in victims)) < (
                        len(best), sum(v.work.gpus for v in best)):
                    best = victims
        if best is not None:
            taken = {v.work.id for v in best}
            for host_id in {v.host_id for v in best}:
                self.by_host[host_id] = [c for c in self.by_host[host_id]
                                         if c.work.id not in taken]
        return best


def can_act(free: FreeGpus, placed: Sequence[PlacedJob]) -> bool:
    """Whether a pass could decide anything: with no GPU free and no running
    preemptible work left to preempt, ``plan_dispatch`` plans nothing whatever
    the queue holds, so a caller may skip reading it."""
    return free.free_count() > 0 or any(
        p.work.preemptible and not p.preempting and p.work.gpus > 0 for p in placed)


def plan_dispatch(pending: Sequence[PendingJob], free: FreeGpus,
                  tenants: Mapping[str, Tenant], usage: UsageLedger,
                  placed: Sequence[PlacedJob], now: float, *,
                  horizon_s: float | None = None, max_preemptions: int = 8) -> DispatchPlan:
    """Decide one pass; ``free`` is updated with the starts it plans."""
    by_id = {job.work.id: job for job in pending}
    loads = load_by_tenant([p.work for p in placed])
    order = order_queue([job.work for job in pending], tenants, usage, loads, now,
                        horizon_s=horizon_s)
    plan = DispatchPlan()
    preemptor = _Preemptor(placed, tenants)
    for work in order:
        job = by_id[work.id]
        placement = free.place(job.spec, job.avoid) if free.free_count() else None
        if placement is not None:
            free.commit(work.id, placement)
            plan.starts.append((job, placement))
            continue
        if len(plan.preemptions) >= max_preemptions or preemptor.claim_incoming(job, free):
            continue
        victims = preemptor.victims_for(job, free)
        if victims:
            plan.preemptions.append((job, victims))
    return plan
