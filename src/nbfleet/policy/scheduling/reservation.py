"""``reservation``: today's notebook platforms (Sensei, Colab, JupyterHub).

One container per session, created when the session opens, with its GPUs bound
exclusively for the session's whole life. Tasks start at once; the GPUs sit idle
between them. Hosts are chosen best-fit (the fewest free GPUs that still fit), so
that releases leave whole hosts empty for scale-in.
"""

from __future__ import annotations

from nbfleet.policy.gpu_fit import choose_gpus
from nbfleet.policy.scheduling.base import FleetPolicy, KernelState
from nbfleet.policy.scheduling.decisions import (
    Decision,
    Placed,
    Started,
    StartPath,
    TaskRequest,
)


class Reservation(FleetPolicy):
    name = "reservation"
    billing = "reserved"

    def place_kernel(self, kernel: KernelState, now: float) -> list[Decision] | None:
        fitting = [(len(h.free_gpus()), h.id) for h in self.hosts.values()
                   if choose_gpus(h.free_gpus(), kernel.spec) is not None]
        if not fitting:
            return None
        host = self.hosts[min(fitting)[1]]
        chosen = choose_gpus(host.free_gpus(), kernel.spec)
        assert chosen is not None
        host.commit(kernel.id, (g.index for g in chosen))
        kernel.hosts = [host.id]
        return [Placed(kernel.id, (host.id,))]

    def start_task(self, task: TaskRequest, kernel: KernelState,
                   now: float) -> list[Decision] | None:
        host = self.hosts[kernel.hosts[0]]
        bound = host.bound(kernel.id)[: task.gpus]
        return [Started(task.id, kernel.id, host.id, bound, StartPath.RESERVED)]
