"""``batch``: a Slurm-like batch scheduler behind the notebook.

Every task is a job: first come, first served (nobody overtakes the head of the
queue), a new container per task on the best-fitting host, GPUs bound only while
the job runs. Sessions hold nothing between tasks, so GPU-hours are the lowest of
all policies, and every task pays a cold start plus loading its state.
"""

from __future__ import annotations

from nbfleet.policy.scheduling.base import FleetPolicy, KernelState
from nbfleet.policy.scheduling.decisions import Decision, Placed, StartPath, TaskRequest


class Batch(FleetPolicy):
    name = "batch"
    strict_fifo = True

    def holds_hosts(self, kernel: KernelState) -> bool:
        return False

    def place_kernel(self, kernel: KernelState, now: float) -> list[Decision] | None:
        return [Placed(kernel.id, ())]  # nothing runs until a task arrives

    def start_task(self, task: TaskRequest, kernel: KernelState,
                   now: float) -> list[Decision] | None:
        return self.best_fit(task, kernel, StartPath.COLD)

    def best_fit(self, task: TaskRequest, kernel: KernelState,
                 path: StartPath) -> list[Decision] | None:
        """Bind on the host with the fewest free GPUs that still fit the task."""
        need = self.task_spec(task, kernel).gpus
        fitting = (h for h in self.hosts.values() if len(h.gpus) - h.committed_gpus >= need)
        for host in sorted(fitting, key=lambda h: (len(h.gpus) - h.committed_gpus, h.id)):
            started = self.bind(task, kernel, host, path)
            if started is not None:
                return [started]
        return None
