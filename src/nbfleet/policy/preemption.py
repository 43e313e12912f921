"""Choosing which running work to preempt so that a pending item can start.

The rules, and why:

* **Only preemptible work of strictly lower priority** may be a victim
  (``may_preempt``). Strictness makes "may preempt" an asymmetric relation:
  if A may preempt B then B may not preempt A, so two items can never take
  turns evicting each other. More generally every preemption replaces work of
  priority below ``p`` with one item of priority ``p``, so the running set's
  priorities, sorted from high to low, grow lexicographically with each
  preemption; that vector has finitely many values, hence no preemption loop.
* **Guarantees hold.** A tenant never ends with fewer running GPUs than
  ``min(guarantee_gpus, what it ran before)``; the pending item's own GPUs count
  for its tenant, so a tenant may swap its own low-priority work for its
  high-priority work.
* **Who pays.** Victims come first from the tenant furthest above its
  guarantee per unit of weight (``(running_gpus - guarantee_gpus) / weight``,
  recomputed after each pick, as in Kueue's fair-sharing preemption), then the
  lowest priority, then the most recently started (the least work lost), then
  the id for determinism.
* **Minimal.** After the greedy pass, victims that are not needed to free
  ``needed_gpus`` are handed back, latest-chosen first, so no victim in the
  result is superfluous (inclusion-minimal, not a minimum-cardinality search).

Pure: callers pass the running work on the hosts where freed GPUs would help
and the shortfall in ``needed_gpus``; placement is not this module's concern.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nbfleet.policy.fairness import QueuedWork, RunningLoad, Tenant

__all__ = [
    "RunningWork",
    "choose_victims",
    "load_by_tenant",
    "may_preempt",
]


@dataclass(frozen=True, slots=True)
class RunningWork:
    """One item holding GPUs now."""

    id: str
    tenant_id: str
    priority: int
    gpus: int
    preemptible: bool
    started_at: float

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"work {self.id!r}: gpus must be >= 0")


def may_preempt(pending: QueuedWork | RunningWork, victim: RunningWork) -> bool:
    """Whether ``pending`` is ever allowed to evict ``victim`` (asymmetric)."""
    return victim.preemptible and victim.priority < pending.priority


def load_by_tenant(running: Iterable[RunningWork]) -> dict[str, RunningLoad]:
    """Running items and GPUs per tenant, as ``order_queue`` takes them."""
    items: dict[str, int] = {}
    gpus: dict[str, int] = {}
    for work in running:
        items[work.tenant_id] = items.get(work.tenant_id, 0) + 1
        gpus[work.tenant_id] = gpus.get(work.tenant_id, 0) + work.gpus
    return {t: RunningLoad(items[t], gpus[t]) for t in sorted(items)}


def choose_victims(
    pending: QueuedWork,
    running: Sequence[RunningWork],
    tenants: Mapping[str, Tenant],
    needed_gpus: int | None = None,
) -> tuple[RunningWork, ...] | None:
    """Victims that free at least ``needed_gpus`` (default: ``pending.gpus``).

    Returns ``()`` when nothing is needed and ``None`` when the greedy pass
    cannot free enough. Without guarantees in play that means no valid set
    exists; where a guarantee leaves a tenant room for only some of its items,
    greedy may miss a set that an exhaustive (knapsack) search would find.
    Raises ``ValueError`` for a tenant missing from ``tenants``.
    """
    need = pending.gpus if needed_gpus is None else needed_gpus
    if need <= 0:
        return ()
    for work in running:
        if work.tenant_id not in tenants:
            raise ValueError(f"running work {work.id!r} names unknown tenant {work.tenant_id!r}")
    if pending.tenant_id not in tenants:
        raise ValueError(f"work {pending.id!r} names unknown tenant {pending.tenant_id!r}")

    held: dict[str, int] = {t: load.gpus for t, load in load_by_tenant(running).items()}
    # The floor each tenant must keep; the pending item's tenant gets its GPUs back.
    floor = {t: min(tenants[t].guarantee_gpus, gpus) for t, gpus in held.items()}
    credit = {t: pending.gpus if t == pending.tenant_id else 0 for t in held}
    now_held = dict(held)

    candidates = [w for w in running if w.gpus > 0 and may_preempt(pending, w)]

    def fits(work: RunningWork) -> bool:
        t = work.tenant_id
        return now_held[t] - work.gpus + credit[t] >= floor[t]

    def preference(work: RunningWork) -> tuple[float, int, float, str]:
        tenant = tenants[work.tenant_id]
        over = (now_held[work.tenant_id] - tenant.guarantee_gpus) / tenant.weight
        return (-over, work.priority, -work.started_at, work.id)

    chosen: list[RunningWork] = []
    freed = 0
    while freed < need:
        eligible = [w for w in candidates if fits(w)]
        if not eligible:
            return None
        victim = min(eligible, key=preference)
        candidates.remove(victim)
        chosen.append(victim)
        now_held[victim.tenant_id] -= victim.gpus
        freed += victim.gpus

    # Hand back victims that are not needed; dropping a victim only raises a
    # tenant's GPUs, so guarantees still hold.
    for victim in reversed(list(chosen)):
        if freed - victim.gpus >= need:
            chosen.remove(victim)
            freed -= victim.gpus
    return tuple(chosen)
