"""The live side of a scheduling policy: it feeds the policy the platform's events
and carries out the decisions the policy answers with.

The policy (``policy/scheduling``) is the very object ``nbfleet sim`` runs; it
never does I/O and reads no clock. This class is the only place the live
platform calls it, so every event passes here in order, on the control plane's
event loop, and every decision is logged (the same record the simulator keeps,
which is how the two are compared). What a decision needs done outside the
model (start a host, prewarm containers, wake a waiting cell, move a kernel) is
handed to the :class:`Effects` the caller supplies.

Identities: a policy *kernel* is a workspace (its runtime holds the GPU
subscription); a policy *task* is one cell, ``{jupyter kernel id}/{msg_id}``.
Time is the scheduler's monotonic clock in seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.resources import HostInventory
from nbfleet.policy.scheduling.adopt import adopt_kernel, adopt_task
from nbfleet.policy.scheduling.base import FleetPolicy, FleetSnapshot
from nbfleet.policy.scheduling.decisions import (
    Decision,
    KernelRequest,
    Migrated,
    Placed,
    Prewarm,
    Queued,
    Reclaimed,
    ScaleIn,
    ScaleOut,
    Started,
    StartPath,
    TaskRequest,
    Unschedulable,
)

log = logging.getLogger(__name__)

DECISION_LOG = 20_000


class CellRefused(Exception):
    """The cell cannot get GPUs (it never fits, or its kernel is not placed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Effects(Protocol):
    """What carrying out decisions needs from the rest of the platform."""

    def scale_out(self, count: int, reason: str) -> None: ...
    def scale_in(self, host_ids: tuple[str, ...]) -> None: ...
    def prewarm(self, host_id: str, count: int) -> None: ...
    def placements_changed(self) -> None: ...
    def migrate(self, move: Migrated) -> None: ...
    def cell_ended(self, task_id: str) -> None: ...
    def kernel_closed(self, workspace_id: str) -> None: ...


class NoEffects:
    """Effects for a scheduler whose decisions only need recording (tests, rebuild)."""

    def scale_out(self, count: int, reason: str) -> None: ...
    def scale_in(self, host_ids: tuple[str, ...]) -> None: ...
    def prewarm(self, host_id: str, count: int) -> None: ...
    def placements_changed(self) -> None: ...
    def migrate(self, move: Migrated) -> None: ...
    def cell_ended(self, task_id: str) -> None: ...
    def kernel_closed(self, workspace_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Binding:
    """GPUs committed to one cell, with what metering and the kernel need."""

    task_id: str
    workspace_id: str
    host_id: str
    gpu_indices: tuple[int, ...]
    gpu_type: str
    path: StartPath
    waited_s: float


@dataclass(slots=True)
class _Waiter:
    task: TaskRequest
    future: asyncio.Future[Started]
    since: float


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    seq: int
    at: float
    decision: Decision


@dataclass(slots=True)
class RunningCell:
    binding: Binding
    started_at: float
    #: When the cell reached its kernel (None while its kernel moves, or its credit
    #: is being reserved): only from then on must the agent report it.
    delivered_at: float | None = None
    #: When its ``execute_reply`` passed the gateway. The GPUs stay committed (and
    #: billed) after it until the agent reports them closed: a process of the slot
    #: may still hold one open (``agent/sandbox/gpus.py``).
    replied_at: float | None = None
    #: The agent reported it ended with a GPU still open in its slot (a CUDA
    #: context): the kernel's next cell takes the GPUs over (``hand_over``).
    held: bool = False
    #: Set once the cell is released, or held: what the kernel's next cell waits for.
    settled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class KernelFacts:
    """A placed kernel as the database records it (for a rebuild)."""

    workspace_id: str
    spec: ResourceSpec
    host_ids: tuple[str, ...]
    reserved: tuple[int, ...] = ()
    #: Whose it is in the fair queue (its project) and that tenant's weight.
    tenant: str = ""
    weight: float = 1.0


@dataclass(slots=True)
class CellFacts:
    """A cell an agent reports running with GPUs bound (for a rebuild)."""

    task_id: str
    workspace_id: str
    host_id: str
    gpu_indices: tuple[int, ...]
    #: How long it has run, by the agent's clock.
    ran_s: float = 0.0
    #: It ended, but a GPU of it is still open in its slot (``ActiveBinding.held``).
    held: bool = False


@dataclass
class LiveScheduler:
    policy: FleetPolicy
    effects: Effects = field(default_factory=NoEffects)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._epoch = self.clock()
        self._waiters: dict[str, _Waiter] = {}
        self.running: dict[str, RunningCell] = {}
        self.log: deque[LoggedDecision] = deque(maxlen=DECISION_LOG)
        #: Hosts where nothing can hold a GPU past its cell (``HostInventory.gpu_holds``):
        #: a cell's GPUs go back at its reply, without waiting for the agent's report.
        self.free_at_reply: set[str] = set()
        #: Autoscaler passes run so far: the simulator's first comes at its start, the
        #: live one's once hosts had time to report (``FleetService.take_over``).
        self.autoscaler_passes = 0
        #: Decisions logged since this scheduler started (the next one's ``seq``).
        self.logged = 0

    def now(self) -> float:
        return self.clock() - self._epoch

    # ------------------------------------------------------------------ hosts
    def host_joined(self, host_id: str, inventory: HostInventory) -> None:
        if host_id in self.policy.hosts:
            return
        if not inventory.gpu_holds:
            self.free_at_reply.add(host_id)
        self._apply(self.policy.add_host(Host.from_inventory(host_id, inventory), self.now()))

    def host_lost(self, host_id: str) -> list[str]:
        """The host is gone; returns the cells that were running there."""
        lost = [t for t, cell in self.running.items() if cell.binding.host_id == host_id]
        for task_id in lost:
            self.running.pop(task_id).settled.set()
            self.effects.cell_ended(task_id)
        self.free_at_reply.discard(host_id)
        self._apply(self.policy.lose_host(host_id, self.now()))
        return lost

    # ---------------------------------------------------------------- kernels
    def open_kernel(self, workspace_id: str, spec: ResourceSpec, tenant: str = "",
                    weight: float = 1.0) -> tuple[str, ...] | None:
        """Place the workspace's kernel (idempotent): its hosts, or None while it
        waits for capacity. Raises CellRefused if it can never be placed. Its cells
        wait in the fair queue as ``tenant`` (its project), of fair-share ``weight``."""
        if tenant:
            self.policy.fair.weights[tenant] = weight
        kernel = self.policy.kernels.get(workspace_id)
        if kernel is None:
            decisions = self.policy.open_session(KernelRequest(workspace_id, spec, tenant),
                                                 self.now())
            self._apply(decisions)
            for decision in decisions:
                if isinstance(decision, Unschedulable) and decision.task_id == workspace_id:
                    raise CellRefused(decision.reason)
            kernel = self.policy.kernels[workspace_id]
        return tuple(kernel.hosts) if kernel.placed else None

    def reserved_gpus(self, workspace_id: str) -> tuple[int, ...]:
        """GPUs held for the kernel's whole life (``reservation``), on its first host."""
        kernel = self.policy.kernels.get(workspace_id)
        if kernel is None or not kernel.hosts or kernel.hosts[0] not in self.policy.hosts:
            return ()
        return self.policy.hosts[kernel.hosts[0]].bound(workspace_id)

    def close_kernel(self, workspace_id: str) -> None:
        for task_id, cell in list(self.running.items()):
            if cell.binding.workspace_id == workspace_id:
                self.release(task_id)
        for task_id, waiter in list(self._waiters.items()):
            if waiter.task.kernel_id == workspace_id:
                self.cancel(task_id)
        self._apply(self.policy.close_session(workspace_id, self.now()))
        self.effects.kernel_closed(workspace_id)

    # ------------------------------------------------------------------ cells
    async def acquire(self, task_id: str, workspace_id: str, gpus: int) -> Binding:
        """Bind GPUs to one cell, waiting in the policy's queue if none are free.

        Cancelling the call (an interrupt, a closed connection) withdraws the cell.
        """
        since = self.now()
        decisions = self.policy.submit(TaskRequest(task_id, workspace_id, gpus), since)
        self._apply(decisions)
        first = decisions[0] if decisions else None
        if isinstance(first, Unschedulable):
            raise CellRefused(first.reason)
        if isinstance(first, Started):
            return self._bound(first, since)
        future: asyncio.Future[Started] = asyncio.get_running_loop().create_future()
        self._waiters[task_id] = _Waiter(TaskRequest(task_id, workspace_id, gpus), future, since)
        try:
            started = await future
        except BaseException:
            self.cancel(task_id)
            raise
        return self._bound(started, since)

    def delivered(self, task_id: str) -> None:
        """The cell's ``execute_request`` was handed to its kernel."""
        cell = self.running.get(task_id)
        if cell is not None and cell.delivered_at is None:
            cell.delivered_at = self.now()

    def replied(self, task_id: str) -> None:
        """The cell's ``execute_reply`` reached the gateway. Its GPUs go back only
        where nothing can hold them past it (``free_at_reply``); elsewhere the agent
        reports when its slot no longer holds them."""
        cell = self.running.get(task_id)
        if cell is None:
            return
        if cell.binding.host_id in self.free_at_reply:
            self.release(task_id)
        elif cell.replied_at is None:
            cell.replied_at = self.now()

    def held(self, task_id: str) -> None:
        """The agent reports the cell ended with one of its GPUs still open in the
        slot: they stay committed to it, and billed, until closed or taken over."""
        cell = self.running.get(task_id)
        if cell is not None:
            cell.held = True
            cell.settled.set()

    def hand_over(self, previous: str, task_id: str, workspace_id: str,
                  gpus: int) -> Binding | None:
        """The kernel's next cell takes over the GPUs its previous cell still holds
        open: they never go back to the pool, where no other kernel could use them.
        None if the previous cell is not held (released, or never its kernel's)."""
        cell = self.running.get(previous)
        if cell is None or not cell.held or cell.binding.workspace_id != workspace_id:
            return None
        decisions = self.policy.hand_over(previous, TaskRequest(task_id, workspace_id, gpus),
                                          self.now())
        if not decisions:
            return None
        del self.running[previous]
        self.effects.cell_ended(previous)
        self._apply(decisions)
        started = decisions[0]
        assert isinstance(started, Started)
        return self._bound(started, self.now())

    def release(self, task_id: str) -> RunningCell | None:
        """The cell's GPUs go back (the agent reported them closed, its kernel or host
        went away, or it never reached its kernel); idempotent."""
        cell = self.running.pop(task_id, None)
        if cell is not None:
            cell.settled.set()
            self.effects.cell_ended(task_id)
        self._apply(self.policy.finish(task_id, self.now()))
        return cell

    def cancel(self, task_id: str) -> bool:
        waiter = self._waiters.pop(task_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.cancel()
        if self.policy.cancel(task_id, self.now()):
            return True
        if task_id in self.policy.running and task_id not in self.running:
            # Started by a decision nobody was waiting for any more: give it back.
            self.release(task_id)
        return waiter is not None

    def wait_reason(self, task_id: str) -> str | None:
        """What a waiting cell is waiting for, in the words the notebook shows."""
        waiter = self._waiters.get(task_id)
        if waiter is None:
            return None
        kernel = self.policy.kernels.get(waiter.task.kernel_id)
        spec = kernel.spec if kernel is not None else ResourceSpec()
        kind = " or ".join(spec.gpu_types) if spec.gpu_types else "GPU"
        what = f"{waiter.task.gpus}x {kind}"
        if spec.vram_gb:
            what += f" with {spec.vram_gb} GB"
        ahead = 0
        for queued in self.policy.queue:
            if queued.id == task_id:
                break
            ahead += 1
        parts = [f"waiting for {what}"]
        if kernel is not None and not kernel.placed:
            parts.append("the kernel is waiting for a host")
        parts.append(f"{ahead} cell{'s' if ahead != 1 else ''} ahead" if ahead else "next in line")
        if self.policy.provisioning:
            parts.append("a host is being added")
        return ": ".join(parts[:1]) + (": " + "; ".join(parts[1:]) if len(parts) > 1 else "")

    def waiting_since(self, task_id: str) -> float | None:
        waiter = self._waiters.get(task_id)
        return None if waiter is None else self.now() - waiter.since

    def _bound(self, started: Started, since: float) -> Binding:
        host = self.policy.hosts[started.host_id]
        types = {g.index: g.gpu_type for g in host.gpus}
        gpu_type = types[started.gpu_indices[0]] if started.gpu_indices else ""
        binding = Binding(started.task_id, started.kernel_id, started.host_id,
                          started.gpu_indices, gpu_type, started.path, self.now() - since)
        self.running[started.task_id] = RunningCell(binding, self.now())
        return binding

    def prewarmed(self, host_id: str, count: int) -> None:
        """Warm containers a ``Prewarm`` asked for are ready on the host."""
        self._apply(self.policy.prewarmed(host_id, count, self.now()))

    # ---------------------------------------------------------------- periodic
    def tick(self) -> None:
        self.autoscaler_passes += 1
        self._apply(self.policy.tick(self.now()))

    def snapshot(self) -> FleetSnapshot:
        return self.policy.snapshot()

    def queue(self) -> list[tuple[TaskRequest, float]]:
        """The waiting cells, in the order they will be served, with their wait."""
        now = self.now()
        return [(t, now - self._waiters[t.id].since if t.id in self._waiters else 0.0)
                for t in self.policy.queue]

    # ----------------------------------------------------------------- rebuild
    def rebuild(self, hosts: Iterable[tuple[str, HostInventory]],
                kernels: Iterable[KernelFacts], cells: Iterable[CellFacts]) -> list[str]:
        """Load the facts into a fresh model; returns the reported cells it refused
        (unknown kernel or host, or a GPU already bound): never a double commit."""
        policy = type(self.policy)(self.policy.config)
        self.policy = policy
        for old in self.running.values():
            old.settled.set()
        self.running.clear()
        for task_id in list(self._waiters):
            self.cancel(task_id)
        prewarms: list[Decision] = []
        self.free_at_reply.clear()
        for host_id, inventory in hosts:
            if not inventory.gpu_holds:
                self.free_at_reply.add(host_id)
            prewarms += [d for d in policy.add_host(Host.from_inventory(host_id, inventory),
                                                    self.now()) if isinstance(d, Prewarm)]
        for facts in kernels:
            if facts.tenant:
                policy.fair.weights[facts.tenant] = facts.weight
            adopt_kernel(policy, KernelRequest(facts.workspace_id, facts.spec, facts.tenant),
                         facts.host_ids, facts.reserved, self.now())
        refused: list[str] = []
        for cell in cells:
            host = policy.hosts.get(cell.host_id)
            reserved = host is not None and bool(host.bound(cell.workspace_id))
            path = StartPath.RESERVED if reserved else StartPath.LOCAL
            task = TaskRequest(cell.task_id, cell.workspace_id, len(cell.gpu_indices))
            started = adopt_task(policy, task, cell.host_id, cell.gpu_indices, path)
            if started is None:
                refused.append(cell.task_id)
                continue
            self._bound(started, self.now())
            self.delivered(cell.task_id)  # an agent reported it: it is in its kernel
            if cell.held:
                self.held(cell.task_id)
        # The hosts' warm pools, as the policy wants them, and a replica for each
        # one a kernel lost with a host that is gone (its standby is made there).
        self._apply(prewarms + policy.fill_replicas())
        return refused

    # ----------------------------------------------------------------- effects
    def _apply(self, decisions: list[Decision]) -> None:
        now = self.now()
        placements = False
        for decision in decisions:
            self.log.append(LoggedDecision(self.logged, now, decision))
            self.logged += 1
            if isinstance(decision, Started):
                waiter = self._waiters.pop(decision.task_id, None)
                if waiter is not None and not waiter.future.done():
                    waiter.future.set_result(decision)
            elif isinstance(decision, ScaleOut):
                self.effects.scale_out(decision.count, decision.reason)
            elif isinstance(decision, ScaleIn):
                self.effects.scale_in(decision.host_ids)
            elif isinstance(decision, (Placed, Reclaimed)):
                placements = True
            elif isinstance(decision, Queued):
                pass
            elif isinstance(decision, Unschedulable):
                waiter = self._waiters.pop(decision.task_id, None)
                if waiter is not None and not waiter.future.done():
                    waiter.future.set_exception(CellRefused(decision.reason))
            elif isinstance(decision, Prewarm):
                self.effects.prewarm(decision.host_id, decision.count)
            elif isinstance(decision, Migrated):
                self.effects.migrate(decision)
        if placements:
            self.effects.placements_changed()
