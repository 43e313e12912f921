"""The bookkeeping every placement policy shares; subclasses decide placement.

A policy owns a model of its fleet (``model.cluster.Host`` objects, the kernels
placed on them, the queue, warm containers) and changes it only in response to
events. Each event method returns the decisions it took, already applied to the
model. Subclasses implement three hooks: where a kernel's containers go
(``place_kernel``), how a task gets GPUs (``start_task``) and, optionally, what a
finished task leaves behind (``after_task``). Everything is deterministic: ties
break on ids, and time only enters as the ``now`` argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.policy.gpu_fit import choose_gpus
from nbfleet.policy.scheduling import autoscaler
from nbfleet.policy.scheduling.config import PolicyConfig
from nbfleet.policy.scheduling.decisions import (
    Decision,
    KernelRequest,
    Prewarm,
    Queued,
    ScaleIn,
    ScaleOut,
    Started,
    StartPath,
    TaskRequest,
    Unschedulable,
)
from nbfleet.policy.scheduling.fair import FairShare


@dataclass(slots=True)
class KernelState:
    id: str
    spec: ResourceSpec
    hosts: list[str] = field(default_factory=list)
    placed: bool = False
    last_executor: str | None = None
    last_active: float = 0.0
    running: str | None = None  # the task it executes (Jupyter runs one cell at a time)
    tenant: str = ""
    priority: int = 0
    #: How many replicas the policy keeps for it now (0: a policy without replicas).
    #: A repair brings it back to this, never past it: a replica the policy removed
    #: on purpose (``nbfleet``'s idle shrink) lowered it.
    want: int = 0


@dataclass(frozen=True, slots=True)
class RunningTask:
    task: TaskRequest
    host_id: str
    path: StartPath


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The figures a simulator or a dashboard samples over time."""

    hosts: int
    provisioning: int
    gpus: int
    committed_gpus: int
    subscribed_gpus: int
    subscription_ratio: float
    kernels: int
    running: int
    queued: int
    warm: int


class FleetPolicy:
    """Base class: subclasses set ``name`` and implement the placement hooks."""

    name: ClassVar[str] = "base"
    strict_fifo: ClassVar[bool] = False
    # What users are billed for: reserved GPUs, standby replicas + execution, or
    # execution only (the paper's billing model, section 5.5.1).
    billing: ClassVar[Literal["reserved", "replicas", "usage"]] = "usage"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.hosts: dict[str, Host] = {}
        self.provisioning = 0
        self.kernels: dict[str, KernelState] = {}
        self.waiting_kernels: deque[str] = deque()
        self.queue: deque[TaskRequest] = deque()
        self.running: dict[str, RunningTask] = {}
        self.warm: dict[str, int] = {}
        self.warming: dict[str, int] = {}
        #: Placed kernels with fewer replicas than they want (a host lost, or no room
        #: when they grew): the only ones a host join looks at.
        self.short: set[str] = set()
        self._shape = Host.from_inventory("shape", self.config.host_shape)
        self._last_scale_out = -math.inf
        self.fair = FairShare(self.config.fair_half_life_s)

    # ------------------------------------------------------------------ hooks
    def place_kernel(self, kernel: KernelState, now: float) -> list[Decision] | None:
        """Create the kernel's containers; None when no host can take them now."""
        raise NotImplementedError

    def start_task(self, task: TaskRequest, kernel: KernelState,
                   now: float) -> list[Decision] | None:
        """Bind GPUs for the task (first decision: ``Started``); None to queue it."""
        raise NotImplementedError

    def after_task(self, running: RunningTask, now: float) -> list[Decision]:
        """What a finished task leaves behind (e.g. a container back to the pool)."""
        return []

    def fleet_wide_key(self, task: TaskRequest, kernel: KernelState) -> Hashable | None:
        """A key such that when ``start_task`` fails for a task, it fails for every
        task of the same key until GPUs are freed (the policy tries every host), or
        None when a failure says nothing about other tasks."""
        return None

    def prewarm_target(self, host: Host) -> int:
        """Warm containers this host should keep."""
        return self.config.prewarm_per_host

    def floor_hosts(self) -> int:
        """Hosts the fleet needs whatever the autoscaler says (e.g. for subscriptions)."""
        return 0

    def evacuate(self, host: Host, now: float) -> list[Decision] | None:
        """Empty a host for scale-in; None if something on it cannot move.

        By default nothing moves: a host is released only if no kernel lives on it
        (a reserved 0-GPU container holds no GPUs but still lives there).
        """
        if host.subscriptions or any(host.id in k.hosts for k in self.kernels.values()):
            return None
        return []

    def kernel_footprint_gpus(self, kernel: KernelState) -> int:
        """GPUs a waiting kernel needs the fleet to grow by."""
        return kernel.spec.gpus

    def hosts_for_waiting(self) -> int:
        """New hosts the waiting kernels need, together, before they can all be
        placed (a replica policy needs ``replicas`` distinct hosts with room for
        each). 0: the GPU sums decide (``_scale_for_backlog`` adds a host when
        they fit but the pieces do not)."""
        return 0

    # ------------------------------------------------------------------ events
    def add_host(self, host: Host, now: float) -> list[Decision]:
        """A provisioned host joined (or one of the initial hosts)."""
        self.provisioning = max(0, self.provisioning - 1)
        self.hosts[host.id] = host
        self.warm[host.id] = 0
        self.warming[host.id] = 0
        return self._refill(host) + self._settle(now)

    def open_session(self, request: KernelRequest, now: float) -> list[Decision]:
        if request.id in self.kernels:
            raise ValueError(f"kernel {request.id} is already open")
        if not fits_shape(self._shape, request.spec) and not any(
                fits_shape(h, request.spec) for h in self.hosts.values()):
            return [Unschedulable(request.id, "no host shape has GPUs that fit "
                                  f"{request.spec.gpus} x {request.spec.gpu_types or 'any'}"
                                  f" with {request.spec.vram_gb} GB")]
        kernel = KernelState(request.id, request.spec, last_active=now, tenant=request.tenant,
                             priority=request.priority)
        self.kernels[kernel.id] = kernel
        self.waiting_kernels.append(kernel.id)
        return self._place_waiting(now) + self._scale_for_backlog(now)

    def close_session(self, kernel_id: str, now: float) -> list[Decision]:
        kernel = self.kernels.pop(kernel_id, None)
        if kernel is None:
            return []
        self.short.discard(kernel_id)
        if kernel_id in self.waiting_kernels:
            self.waiting_kernels.remove(kernel_id)
        self.queue = deque(t for t in self.queue if t.kernel_id != kernel_id)
        for host_id in kernel.hosts:
            if host_id in self.hosts:
                self.hosts[host_id].unsubscribe(kernel_id)
        return self._settle(now)

    def submit(self, task: TaskRequest, now: float) -> list[Decision]:
        kernel = self.kernels.get(task.kernel_id)
        if kernel is None:
            return [Unschedulable(task.id, f"kernel {task.kernel_id} is not open "
                                  "(it could not be placed, or it was closed)")]
        if task.id in self.running or any(q.id == task.id for q in self.queue):
            raise ValueError(f"task {task.id} was already submitted")
        kernel.last_active = now
        if kernel.placed and (not self.strict_fifo or not self.queue):
            started = self.start_task(task, kernel, now)
            if started is not None:
                self.record_start(task, started, now)
                return started
        self.queue.append(task)
        self.fair.submitted(task.id, now)
        reason = "waiting for its kernel to be placed" if not kernel.placed else "no free GPUs"
        return [Queued(task.id, reason), *self._scale_for_backlog(now)]

    def finish(self, task_id: str, now: float) -> list[Decision]:
        """The task ended (reply, interrupt, death). Unknown ids are ignored, so a
        release reported twice (by the gateway and by the agent) is harmless."""
        running = self.running.pop(task_id, None)
        if running is None:
            return []
        host = self.hosts.get(running.host_id)
        if host is not None:
            host.release(task_id)
        kernel = self.kernels.get(running.task.kernel_id)
        self.fair.finished(task_id, now)
        if kernel is not None:
            kernel.last_active = now
            kernel.running = None
        return self.after_task(running, now) + self._settle(now)

    def hand_over(self, previous: str, task: TaskRequest, now: float) -> list[Decision]:
        """The kernel's next task takes over the GPUs its previous one still holds
        (live: a CUDA context keeps them open after the cell); [] if ``previous`` is
        not running, is another kernel's, or holds a different number of GPUs."""
        running = self.running.get(previous)
        kernel = self.kernels.get(task.kernel_id)
        host = self.hosts.get(running.host_id) if running is not None else None
        if (running is None or kernel is None or host is None or task.id in self.running
                or running.task.kernel_id != task.kernel_id or running.task.gpus != task.gpus):
            return []
        del self.running[previous]
        self.fair.finished(previous, now)
        if running.path is StartPath.RESERVED:
            indices = host.bound(kernel.id)
        else:
            indices = host.bound(previous)
            host.release(previous)
            host.commit(task.id, indices)
        started = Started(task.id, kernel.id, host.id, indices, running.path)
        kernel.last_active = now
        self.record_start(task, [started], now)
        return [started]

    def cancel(self, task_id: str, now: float) -> bool:
        """Withdraw a queued task (its cell was interrupted while it waited)."""
        kept = deque(t for t in self.queue if t.id != task_id)
        cancelled = len(kept) != len(self.queue)
        self.queue = kept
        self.fair.withdrawn(task_id)
        return cancelled

    def lose_host(self, host_id: str, now: float) -> list[Decision]:
        """A host died or left without being emptied: what ran there is gone.

        Its tasks end (the caller reports them interrupted), its replicas are
        dropped, and kernels left with no replica wait to be placed again.
        """
        host = self.hosts.pop(host_id, None)
        if host is None:
            return []
        self.warm.pop(host_id, None)
        self.warming.pop(host_id, None)
        for task_id in [t for t, r in self.running.items() if r.host_id == host_id]:
            running = self.running.pop(task_id)
            self.fair.finished(task_id, now)
            kernel = self.kernels.get(running.task.kernel_id)
            if kernel is not None:
                kernel.running = None
        for kernel in self.kernels.values():
            if host_id not in kernel.hosts:
                continue
            kernel.hosts.remove(host_id)
            if kernel.last_executor == host_id:
                kernel.last_executor = None
            if not kernel.hosts and kernel.placed and self.holds_hosts(kernel):
                kernel.placed = False
                self.waiting_kernels.append(kernel.id)
        return self._settle(now) + self._scale_for_backlog(now)

    def fill_replicas(self) -> list[Decision]:
        """Give the kernels short of the replicas they want (``short``: a host was
        lost, or there was no room) new ones where they fit; none for policies
        without replicas."""
        return []

    #: Whether its kernels keep replicas that a lost host's repair replaces.
    keeps_replicas: ClassVar[bool] = False

    def holds_hosts(self, kernel: KernelState) -> bool:
        """Whether this policy's placed kernels live on hosts (not so for ``batch``
        and ``lcp``, whose sessions own nothing between tasks)."""
        return True

    def prewarmed(self, host_id: str, count: int, now: float) -> list[Decision]:
        """Containers a ``Prewarm`` asked for are ready (ignored if the host left)."""
        if host_id not in self.hosts:
            return []
        self.warming[host_id] = max(0, self.warming[host_id] - count)
        self.warm[host_id] += count
        return self._drain(now)

    def tick(self, now: float) -> list[Decision]:
        """The autoscaler's periodic pass (and, in subclasses, idle reclamation)."""
        scale = self._scale_plan()
        if scale.add:
            return [self._scale_out(scale.add, now,
                                    f"expected capacity {scale.expected_hosts} hosts")]
        cooling = now - self._last_scale_out < self.config.autoscaler.scale_in_cooldown_s
        if scale.remove and not cooling:
            return self._scale_in(scale.remove, now)
        return []

    # -------------------------------------------------------------- queries
    def demanded_gpus(self) -> int:
        """Committed GPUs plus what queued work and waiting kernels need."""
        committed = sum(h.committed_gpus for h in self.hosts.values())
        queued = sum(t.gpus for t in self.queue)
        waiting = sum(self.kernel_footprint_gpus(self.kernels[k]) for k in self.waiting_kernels)
        return committed + queued + waiting

    def snapshot(self) -> FleetSnapshot:
        gpus = sum(len(h.gpus) for h in self.hosts.values())
        subscribed = sum(h.subscribed_gpus for h in self.hosts.values())
        return FleetSnapshot(
            hosts=len(self.hosts), provisioning=self.provisioning, gpus=gpus,
            committed_gpus=sum(h.committed_gpus for h in self.hosts.values()),
            subscribed_gpus=subscribed,
            subscription_ratio=subscribed / (gpus * self.config.replicas) if gpus else 0.0,
            kernels=len(self.kernels), running=len(self.running), queued=len(self.queue),
            warm=sum(self.warm.values()))

    def task_spec(self, task: TaskRequest, kernel: KernelState) -> ResourceSpec:
        if task.gpus == kernel.spec.gpus:
            return kernel.spec
        if task.gpus == 0:
            return ResourceSpec(kernel.spec.millicpus, kernel.spec.memory_mb)
        return replace(kernel.spec, gpus=task.gpus)

    # ------------------------------------------------------------- helpers
    def bind(self, task: TaskRequest, kernel: KernelState, host: Host,
             path: StartPath) -> Started | None:
        """Commit fitting free GPUs on ``host`` to the task, or None if there are none."""
        chosen = choose_gpus(host.free_gpus(), self.task_spec(task, kernel))
        if chosen is None:
            return None
        indices = host.commit(task.id, (g.index for g in chosen))
        return Started(task.id, kernel.id, host.id, indices, path)

    def take_warm(self, host_id: str) -> list[Decision]:
        """Use one warm container on the host and ask for its replacement."""
        self.warm[host_id] -= 1
        self.warming[host_id] += 1
        return [Prewarm(host_id, 1)]

    def _refill(self, host: Host) -> list[Decision]:
        missing = self.prewarm_target(host) - self.warm[host.id] - self.warming[host.id]
        if missing <= 0:
            return []
        self.warming[host.id] += missing
        return [Prewarm(host.id, missing)]

    def record_start(self, task: TaskRequest, decisions: list[Decision], now: float) -> None:
        started = decisions[0]
        assert isinstance(started, Started)
        self.running[task.id] = RunningTask(task, started.host_id, started.path)
        kernel = self.kernels[task.kernel_id]
        self.fair.started(task, kernel.tenant, now)
        kernel.last_executor = started.host_id
        kernel.running = task.id

    def _tenant_of(self, kernel_id: str) -> tuple[str, int]:
        kernel = self.kernels.get(kernel_id)
        return ("", 0) if kernel is None else (kernel.tenant, kernel.priority)

    def _settle(self, now: float) -> list[Decision]:
        """After capacity changed: place waiting kernels, then start queued tasks."""
        return self._place_waiting(now) + self._drain(now)

    def _place_waiting(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        for kernel_id in list(self.waiting_kernels):
            kernel = self.kernels[kernel_id]
            placed = self.place_kernel(kernel, now)
            if placed is None:
                continue
            self.waiting_kernels.remove(kernel_id)
            kernel.placed = True
            out += placed
        return out

    def _drain(self, now: float) -> list[Decision]:
        """Start what queued work now fits, in the fair queue's order."""
        out: list[Decision] = []
        self.queue = self.fair.order(self.queue, self._tenant_of, now)
        # What could not start anywhere in this pass cannot later in it either (GPUs
        # only get taken): tasks alike are not tried again (``fleet_wide_key``).
        failed: set[Hashable] = set()
        kept: deque[TaskRequest] = deque()
        while self.queue:
            task = self.queue.popleft()
            kernel = self.kernels[task.kernel_id]
            key = self.fleet_wide_key(task, kernel) if kernel.placed else None
            started = (self.start_task(task, kernel, now)
                       if kernel.placed and (key is None or key not in failed) else None)
            if started is None:
                if key is not None:
                    failed.add(key)
                kept.append(task)
                if self.strict_fifo:  # first come, first served: nobody overtakes the head
                    kept.extend(self.queue)
                    self.queue.clear()
                continue
            self.record_start(task, started, now)
            out += started
        self.queue = kept
        return out

    def _scale_plan(self) -> autoscaler.ScalePlan:
        return autoscaler.plan(
            self.config.autoscaler, ready_hosts=len(self.hosts),
            provisioning=self.provisioning, demanded_gpus=self.demanded_gpus(),
            gpus_per_host=self.config.gpus_per_host, floor_hosts=self.floor_hosts())

    def _scale_out(self, count: int, now: float, reason: str) -> ScaleOut:
        self.provisioning += count
        self._last_scale_out = now
        return ScaleOut(count, reason)

    def _scale_for_backlog(self, now: float) -> list[Decision]:
        """Scale out at once when work waits and pending hosts will not cover it."""
        if not self.queue and not self.waiting_kernels:
            return []
        add = self._scale_plan().add
        # A kernel that needs several new hosts (distinct replica hosts) gets them all
        # at once, not one per provisioning round: it waits one host's start, no more.
        add = max(add, self.hosts_for_waiting() - self.provisioning)
        room = self.config.autoscaler.max_hosts - len(self.hosts) - self.provisioning
        if not add and self.provisioning == 0 and room > 0:
            add = 1  # the sums fit but the pieces do not (fragmentation, distinct hosts)
        add = min(add, max(room, 0))
        if add <= 0:
            return []
        return [self._scale_out(add, now, "work is waiting for GPUs")]

    def _scale_in(self, limit: int, now: float) -> list[Decision]:
        out: list[Decision] = []
        released: list[str] = []
        for host in self._idle_hosts():
            if len(released) == limit or len(self.hosts) <= self.floor_hosts():
                break
            moved = self.evacuate(host, now)
            if moved is None:
                continue
            out += moved
            released.append(host.id)
            del self.hosts[host.id], self.warm[host.id], self.warming[host.id]
        if released:
            out.append(ScaleIn(tuple(released)))
        return out

    def _idle_hosts(self) -> Iterable[Host]:
        """Hosts running nothing (a 0-GPU task commits no GPUs but still runs there),
        the least subscribed first: the cheapest to empty."""
        running_on = {r.host_id for r in self.running.values()}
        idle = [h for h in self.hosts.values()
                if h.committed_gpus == 0 and h.id not in running_on]
        return sorted(idle, key=lambda h: (h.subscribed_gpus, h.id))


def fits_shape(host: Host, spec: ResourceSpec) -> bool:
    """Whether the host has GPUs that could ever run ``spec`` (free or not)."""
    return spec.gpus == 0 or choose_gpus(host.gpus, spec) is not None

