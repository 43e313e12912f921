"""``nbfleet``: NotebookOS's replicated kernels, with replicas that follow activity.

What the traces teach (seed 004, section 2.3, and our synthetic Sensei trace):
about 75 % of sessions use their GPUs at most 5 % of their life, sessions live
for days, and a session's tasks come in bursts with a few minutes of think time
between them (IAT p50 5 min, p99 about an hour). In ``notebookos`` every open
session keeps three replicas subscribed for its whole life, so the hosts it
provisions are set by *subscriptions*, i.e. by sessions that are mostly asleep,
not by the GPUs that tasks use.

So ``nbfleet`` keeps the full set of replicas only around bursts:

* **Shrink when idle.** A kernel with no task for ``shrink_idle_s`` (default 1 h,
  past the IAT p99, so a burst is rarely cut) keeps ``idle_replicas`` (2)
  replicas, on the hosts with the most free GPUs. Its state lives there and in
  the store, so nothing is lost; the other replica's subscription is freed. (One
  replica saves more GPU-hours but loses interactivity: ``docs/simulation.md``.)
* **Grow on activity.** When the kernel runs a task, its missing replicas are
  placed again in the background (off the critical path). The next task of the
  burst has all three to choose from, exactly as in ``notebookos``.
* **Pack tasks.** Among the replica hosts that have enough free GPUs, a task
  prefers the last executor (its GPUs may still hold the model), then the one
  with the *fewest* free GPUs (best fit), where ``notebookos`` takes the most.
  Spreading tasks fragments every host; packing keeps whole hosts free for the
  4- and 8-GPU tasks, which otherwise migrate or wait for a new host.
* Migration, the SR limit and autoscaling are ``notebookos``'s.

The first task after a long idle period has one replica to try instead of
three; if that host is full it migrates (a warm container when one exists). The
trade is measured in ``docs/simulation.md``.
"""

from __future__ import annotations

from nbfleet.model.cluster import Host
from nbfleet.policy.scheduling.base import KernelState
from nbfleet.policy.scheduling.config import AutoscalerConfig, PolicyConfig
from nbfleet.policy.scheduling.decisions import (
    Decision,
    Placed,
    Reclaimed,
    StartPath,
    TaskRequest,
)
from nbfleet.policy.scheduling.notebookos import NotebookOS


class NbfleetPolicy(NotebookOS):
    name = "nbfleet"

    @staticmethod
    def default_config() -> PolicyConfig:
        return PolicyConfig(replicas=3, prewarm_per_host=1, shrink_idle_s=3600.0,
                            idle_replicas=2, autoscaler=AutoscalerConfig(scaling_buffer=1))

    def start_task(self, task: TaskRequest, kernel: KernelState,
                   now: float) -> list[Decision] | None:
        need = self.task_spec(task, kernel).gpus
        replicas = [self.hosts[h] for h in kernel.hosts]
        replicas.sort(key=lambda h: (len(h.free_gpus()) < need, h.id != kernel.last_executor,
                                     len(h.free_gpus()), h.id))
        started: list[Decision] | None = None
        for host in replicas:
            local = self.bind(task, kernel, host, StartPath.LOCAL)
            if local is not None:
                started = [local]
                break
        else:
            started = self.migrate_and_start(task, kernel)
        return None if started is None else started + self._grow(kernel)

    def migration_order(self, host: Host) -> tuple[bool, int, float, str]:
        """Best fit, as for local starts: the fewest free GPUs that still fit (the
        targets all fit), so a migration does not break a whole free host that a
        wide task could have had; a warm container first."""
        return (self.warm[host.id] == 0, len(host.gpus) - host.committed_gpus,
                self._sr_after(host, 0), host.id)

    def tick(self, now: float) -> list[Decision]:
        return self._shrink_idle(now) + super().tick(now)

    def _grow(self, kernel: KernelState) -> list[Decision]:
        """Place the replicas the kernel gave up, where the SR limit allows (those
        that do not fit now follow when a host joins: it is ``short``)."""
        if kernel.want >= self.config.replicas and len(kernel.hosts) >= kernel.want:
            return []
        kernel.want = self.config.replicas
        added = self._add_replicas(kernel, kernel.want - len(kernel.hosts))
        return [Placed(kernel.id, added)] if added else []

    def _shrink_idle(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        keep = self.config.idle_replicas
        for kernel in self.kernels.values():
            if (not kernel.placed or kernel.running is not None or len(kernel.hosts) <= keep
                    or now - kernel.last_active < self.config.shrink_idle_s):
                continue
            ranked = sorted(kernel.hosts,
                            key=lambda h: (-len(self.hosts[h].free_gpus()), h))
            dropped = ranked[keep:]
            for host_id in dropped:
                self.hosts[host_id].unsubscribe(kernel.id)
            kernel.hosts = ranked[:keep]
            kernel.want = keep  # on purpose: no repair gives them back
            self.short.discard(kernel.id)
            if kernel.last_executor not in kernel.hosts:
                kernel.last_executor = None
            out.append(Reclaimed(kernel.id, tuple(dropped)))
        return out
