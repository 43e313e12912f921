"""``lcp``: NotebookOS's "large container pool" baseline.

Sessions own no containers. Every host keeps a large pool of pre-warmed
containers; a task takes one on a host with free GPUs (best fit), loads the
session's state into it, runs, and gives the container back to the pool. With no
warm container there, a new one is started cold and joins the pool afterwards.
"""

from __future__ import annotations

from collections.abc import Hashable

from nbfleet.policy.scheduling.base import FleetPolicy, KernelState, RunningTask
from nbfleet.policy.scheduling.decisions import Decision, Placed, StartPath, TaskRequest


class LargeContainerPool(FleetPolicy):
    name = "lcp"

    def holds_hosts(self, kernel: KernelState) -> bool:
        return False

    def place_kernel(self, kernel: KernelState, now: float) -> list[Decision] | None:
        return [Placed(kernel.id, ())]

    def start_task(self, task: TaskRequest, kernel: KernelState,
                   now: float) -> list[Decision] | None:
        # The counts first: only a host with enough GPUs free can bind the task.
        need = self.task_spec(task, kernel).gpus
        hosts = sorted((h for h in self.hosts.values() if len(h.gpus) - h.committed_gpus >= need),
                       key=lambda h: (self.warm[h.id] == 0, len(h.gpus) - h.committed_gpus, h.id))
        for host in hosts:
            warm = self.warm[host.id] > 0
            started = self.bind(task, kernel, host, StartPath.WARM if warm else StartPath.COLD)
            if started is None:
                continue
            if warm:
                self.warm[host.id] -= 1  # it comes back after the task; no refill needed
            return [started]
        return None

    def fleet_wide_key(self, task: TaskRequest, kernel: KernelState) -> Hashable:
        """Any host may run any task: one that cannot start, no task of its spec can."""
        return self.task_spec(task, kernel)

    def after_task(self, running: RunningTask, now: float) -> list[Decision]:
        host_id = running.host_id
        if host_id in self.hosts:
            # The container rejoins the pool unless refills in flight already fill it.
            room = self.prewarm_target(self.hosts[host_id]) - self.warming[host_id]
            if self.warm[host_id] < room:
                self.warm[host_id] += 1
        return []
