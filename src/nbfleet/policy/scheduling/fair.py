"""Which waiting cell goes first: the fleet's fairness (``policy/fairness.py``),
applied to the policies' queue of cells.

A kernel belongs to a *tenant* (live: its project) with a priority tier and a
fair-share weight; its cells inherit them. While the queue holds cells of one
tenant and tier only, it stays first come, first served (so a trace without
tenants simulates exactly as before). When several compete, the queue is
ordered as batch jobs are: a higher tier strictly first, then the tenant with the
lowest decayed GPU-seconds (plus what it holds now) per unit of weight, FIFO
within a tenant. Usage is the GPU time of the cells that ran, decayed with the
configured half-life; it lives in the model, so a rebuilt model starts it afresh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from nbfleet.policy.fairness import QueuedWork, RunningLoad, Tenant, UsageLedger, order_queue
from nbfleet.policy.scheduling.decisions import TaskRequest


class FairShare:
    def __init__(self, half_life_s: float) -> None:
        self.usage = UsageLedger(half_life_s)
        #: tenant -> fair-share weight (default 1).
        self.weights: dict[str, float] = {}
        self._submitted: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def submitted(self, task_id: str, now: float) -> None:
        self._submitted.setdefault(task_id, now)

    def started(self, task_id: str, now: float) -> None:
        self._submitted.pop(task_id, None)
        self._started[task_id] = now

    def withdrawn(self, task_id: str) -> None:
        self._submitted.pop(task_id, None)

    def finished(self, task: TaskRequest, tenant: str, now: float) -> None:
        """Charge the cell's GPU-seconds to its tenant."""
        began = self._started.pop(task.id, now)
        if task.gpus and now > began:
            self.usage = self.usage.record(tenant, task.gpus * (now - began), now)

    def order(self, queue: deque[TaskRequest], tenant_of: Callable[[str], tuple[str, int]],
              running: Iterable[TaskRequest], now: float) -> deque[TaskRequest]:
        """``queue`` in the order to try it; ``tenant_of`` maps a kernel to its
        (tenant, tier), ``running`` are the cells running now (read only when
        tenants compete, so a one-tenant queue costs one pass over itself)."""
        if len(queue) < 2:
            return queue
        groups = {tenant_of(t.kernel_id) for t in queue}
        if len(groups) < 2:
            return queue
        tenants = {tenant: Tenant(tenant, self.weights.get(tenant, 1.0))
                   for tenant, _ in groups}
        load: dict[str, RunningLoad] = {}
        for task in running:
            tenant = tenant_of(task.kernel_id)[0]
            if tenant in tenants:
                old = load.get(tenant, RunningLoad())
                load[tenant] = RunningLoad(old.items + 1, old.gpus + task.gpus)
        works = [QueuedWork(t.id, *tenant_of(t.kernel_id), t.gpus,
                            self._submitted.get(t.id, now), False) for t in queue]
        by_id = {t.id: t for t in queue}
        return deque(by_id[w.id] for w in order_queue(works, tenants, self.usage, load, now))
