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
from collections.abc import Callable

from nbfleet.policy.fairness import QueuedWork, RunningLoad, Tenant, UsageLedger, order_queue
from nbfleet.policy.scheduling.decisions import TaskRequest


class FairShare:
    def __init__(self, half_life_s: float) -> None:
        self.usage = UsageLedger(half_life_s)
        #: tenant -> fair-share weight (default 1).
        self.weights: dict[str, float] = {}
        self._submitted: dict[str, float] = {}
        #: task -> (started at, tenant, GPUs): what each running cell charges.
        self._started: dict[str, tuple[float, str, int]] = {}
        #: tenant -> [running cells, their GPUs], kept as cells start and end so
        #: ordering never walks the running cells (thousands, on a big fleet).
        self._load: dict[str, list[int]] = {}

    def submitted(self, task_id: str, now: float) -> None:
        self._submitted.setdefault(task_id, now)

    def started(self, task: TaskRequest, tenant: str, now: float) -> None:
        self._submitted.pop(task.id, None)
        self._started[task.id] = (now, tenant, task.gpus)
        load = self._load.setdefault(tenant, [0, 0])
        load[0] += 1
        load[1] += task.gpus

    def withdrawn(self, task_id: str) -> None:
        self._submitted.pop(task_id, None)

    def finished(self, task_id: str, now: float) -> None:
        """Charge the cell's GPU-seconds to the tenant it started as."""
        entry = self._started.pop(task_id, None)
        if entry is None:
            return
        began, tenant, gpus = entry
        load = self._load[tenant]
        load[0] -= 1
        load[1] -= gpus
        if load[0] == 0:
            del self._load[tenant]
        if gpus and now > began:
            self.usage = self.usage.record(tenant, gpus * (now - began), now)

    def order(self, queue: deque[TaskRequest], tenant_of: Callable[[str], tuple[str, int]],
              now: float) -> deque[TaskRequest]:
        """``queue`` in the order to try it; ``tenant_of`` maps a kernel to its
        (tenant, tier). A one-tenant queue costs one pass over itself."""
        if len(queue) < 2:
            return queue
        groups = {tenant_of(t.kernel_id) for t in queue}
        if len(groups) < 2:
            return queue
        tenants = {tenant: Tenant(tenant, self.weights.get(tenant, 1.0))
                   for tenant, _ in groups}
        load = {tenant: RunningLoad(*self._load[tenant])
                for tenant in tenants if tenant in self._load}
        works = [QueuedWork(t.id, *tenant_of(t.kernel_id), t.gpus,
                            self._submitted.get(t.id, now), False) for t in queue]
        by_id = {t.id: t for t in queue}
        return deque(by_id[w.id] for w in order_queue(works, tenants, self.usage, load, now))
