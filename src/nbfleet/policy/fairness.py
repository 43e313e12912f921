"""Ordering queued GPU work across tenants: priority tiers, then weighted fair share.

Why this shape (the same ideas as Kueue's fair sharing, without its framework):

* **Tiers are strict.** A higher ``priority`` (e.g. paid=10 over free=0) always
  comes first, however much lower-tier work is queued or how long it has waited.
  A flood of free jobs can therefore never sit in front of a paid job.
* **Within a tier, weighted fair share.** Each tenant ``t`` has a score::

      score(t) = (usage(t, now) + horizon_s * (running_gpus(t) + picked_gpus(t))) / weight(t)

  ``usage`` is the tenant's GPU-seconds with exponential decay (``UsageLedger``),
  so old consumption is forgiven over a few half-lives rather than held against
  a tenant forever. ``running_gpus`` is what the tenant holds right now; a GPU
  held now is charged ``horizon_s`` GPU-seconds (by default one half-life: the
  time scale over which the ledger remembers), which puts both terms in the
  same unit. The tenant with the *lowest* score goes next. Dividing by the
  weight means a weight-2 tenant may hold twice the share of a weight-1 tenant
  before it loses its turn.
* **Recomputed per pick.** Each pick adds the item's GPUs (at least one) to
  ``picked_gpus``, so a tenant's score rises as its items are ordered. One
  tenant's flood interleaves with everyone else's work instead of going first
  as a block; over a long run, picks are proportional to weights.
* **FIFO within a tenant**, by ``(submitted_at, id)``; ties between tenants go
  to the earlier head item, then the smaller tenant id, so the order is
  deterministic.
* **Concurrency caps.** A tenant whose running plus picked items reach its
  ``max_running`` gets no more picks in this pass; its remaining items are left
  out of the result (they cannot start now). The pass assumes every earlier
  pick starts; if placement fails for some, the next pass corrects it.

Everything here is pure: time is a float of seconds passed in by the caller.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "QueuedWork",
    "RunningLoad",
    "Tenant",
    "UsageLedger",
    "decayed",
    "order_queue",
]


@dataclass(frozen=True, slots=True)
class Tenant:
    """A party that shares the fleet: its fair-share weight, the GPUs preemption
    may never take it below, and an optional cap on its running items."""

    id: str
    weight: float
    guarantee_gpus: int = 0
    max_running: int | None = None

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"tenant {self.id!r}: weight must be positive, got {self.weight}")
        if self.guarantee_gpus < 0:
            raise ValueError(f"tenant {self.id!r}: guarantee_gpus must be >= 0")
        if self.max_running is not None and self.max_running < 0:
            raise ValueError(f"tenant {self.id!r}: max_running must be >= 0")


@dataclass(frozen=True, slots=True)
class QueuedWork:
    """One item waiting for GPUs. Higher ``priority`` is a more important tier."""

    id: str
    tenant_id: str
    priority: int
    gpus: int
    submitted_at: float
    preemptible: bool

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"work {self.id!r}: gpus must be >= 0")


@dataclass(frozen=True, slots=True)
class RunningLoad:
    """What a tenant holds right now: running items (for ``max_running``) and
    their GPUs (for the fair-share score)."""

    items: int = 0
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class _Sample:
    value: float  # GPU-seconds as of ``at``
    at: float


@dataclass(frozen=True)
class UsageLedger:
    """Decayed GPU-seconds per tenant; an immutable value (``record`` returns a
    new ledger) so a simulator can keep or share snapshots freely.

    Decay is applied lazily from each tenant's last update:
    ``usage(now) = value * 0.5 ** ((now - at) / half_life_s)``. Time that runs
    backwards (clock skew between callers) is treated as no time passing, so
    usage never grows by itself.
    """

    half_life_s: float
    _samples: Mapping[str, _Sample] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (self.half_life_s > 0 and math.isfinite(self.half_life_s)):
            raise ValueError(f"half_life_s must be positive, got {self.half_life_s}")

    @classmethod
    def of(cls, half_life_s: float, samples: Mapping[str, tuple[float, float]]) -> UsageLedger:
        """A ledger from stored (GPU-seconds, as of time) pairs per tenant."""
        return cls(half_life_s, {t: _Sample(value, at) for t, (value, at) in samples.items()})

    def usage(self, tenant_id: str, now: float) -> float:
        """The tenant's decayed GPU-seconds at ``now``; 0 for an unknown tenant."""
        sample = self._samples.get(tenant_id)
        if sample is None:
            return 0.0
        return decayed(sample.value, now - sample.at, self.half_life_s)

    def record(self, tenant_id: str, gpu_seconds: float, now: float) -> UsageLedger:
        """A new ledger with ``gpu_seconds`` more usage charged to the tenant at ``now``."""
        if not (gpu_seconds >= 0 and math.isfinite(gpu_seconds)):
            raise ValueError(f"gpu_seconds must be finite and >= 0, got {gpu_seconds}")
        old = self._samples.get(tenant_id)
        at = now if old is None else max(now, old.at)
        value = self.usage(tenant_id, at) + gpu_seconds
        samples = dict(self._samples)
        samples[tenant_id] = _Sample(value, at)
        return UsageLedger(self.half_life_s, samples)

    def tenants(self) -> frozenset[str]:
        """The tenants with any recorded usage."""
        return frozenset(self._samples)


def decayed(value: float, elapsed_s: float, half_life_s: float) -> float:
    """``value`` after ``elapsed_s`` of exponential decay; time running backwards
    counts as none."""
    return value * math.pow(0.5, max(0.0, elapsed_s) / half_life_s)


def _fifo_key(work: QueuedWork) -> tuple[float, str]:
    return (work.submitted_at, work.id)


def order_queue(
    queue: Iterable[QueuedWork],
    tenants: Mapping[str, Tenant],
    usage: UsageLedger,
    running_per_tenant: Mapping[str, RunningLoad],
    now: float,
    *,
    horizon_s: float | None = None,
) -> list[QueuedWork]:
    """The queue in the order to try starting it (see the module docstring).

    Items of tenants at their ``max_running`` cap are left out. ``horizon_s``
    (default: the ledger's half-life) is how many GPU-seconds one held GPU
    counts for in the score. Raises ``ValueError`` for an unknown tenant.
    """
    horizon = usage.half_life_s if horizon_s is None else horizon_s
    if not (horizon >= 0 and math.isfinite(horizon)):
        raise ValueError(f"horizon_s must be finite and >= 0, got {horizon}")

    tiers: dict[int, dict[str, list[QueuedWork]]] = defaultdict(lambda: defaultdict(list))
    for work in queue:
        if work.tenant_id not in tenants:
            raise ValueError(f"work {work.id!r} names unknown tenant {work.tenant_id!r}")
        tiers[work.priority][work.tenant_id].append(work)

    # Running plus picked so far, carried across tiers: a pick in a higher tier
    # counts against the same tenant's cap and share in the lower ones.
    items: dict[str, int] = {}
    gpus: dict[str, int] = {}
    base: dict[str, float] = {}
    for tenant_id in tenants:
        load = running_per_tenant.get(tenant_id, RunningLoad())
        items[tenant_id] = load.items
        gpus[tenant_id] = load.gpus
        base[tenant_id] = usage.usage(tenant_id, now)

    def capped(tenant_id: str) -> bool:
        cap = tenants[tenant_id].max_running
        return cap is not None and items[tenant_id] >= cap

    def score(tenant_id: str) -> float:
        return (base[tenant_id] + horizon * gpus[tenant_id]) / tenants[tenant_id].weight

    ordered: list[QueuedWork] = []
    for priority in sorted(tiers, reverse=True):
        heap: list[tuple[float, float, str, str]] = []
        fifo: dict[str, deque[QueuedWork]] = {}
        for tenant_id, works in tiers[priority].items():
            fifo[tenant_id] = deque(sorted(works, key=_fifo_key))
            if not capped(tenant_id):
                head = fifo[tenant_id][0]
                heap.append((score(tenant_id), head.submitted_at, head.id, tenant_id))
        heapq.heapify(heap)
        while heap:
            _, _, _, tenant_id = heapq.heappop(heap)
            work = fifo[tenant_id].popleft()
            ordered.append(work)
            items[tenant_id] += 1
            gpus[tenant_id] += max(work.gpus, 1)
            if fifo[tenant_id] and not capped(tenant_id):
                head = fifo[tenant_id][0]
                heapq.heappush(heap, (score(tenant_id), head.submitted_at, head.id, tenant_id))
    return ordered
