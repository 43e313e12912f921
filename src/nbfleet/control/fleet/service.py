"""The fleet service: one live scheduler per control plane, on the lease holder.

The scheduling policy keeps its model in memory, so exactly one control-plane
replica may feed it: the one holding the workspace reconciler's lease (which
also places workspaces). When a replica takes the lease, it *rebuilds* the
model from what is already true before it decides anything: the hosts that are
alive, the GPU workspaces placed on them (the database), and the cells the
agents report running with GPUs bound (each agent, asked directly). So a
restart or a second replica neither loses nor double-commits a GPU.

Every call into the scheduler happens on the event loop; the reconciler and the
gateway call this service from async code only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from nbfleet.control.drain import Homes, empty_host
from nbfleet.control.fleet import facts
from nbfleet.control.fleet.cellgate import GateRegistry
from nbfleet.control.fleet.metering import CellMeter
from nbfleet.control.fleet.prewarm import warm_pool_ready
from nbfleet.control.fleet.provider import HostProvider
from nbfleet.control.fleet.scaling import Scaler
from nbfleet.control.fleet.scheduler import (
    Binding,
    CellRefused,
    LiveScheduler,
)
from nbfleet.control.fleet.sizing import outgrown, sized_policy
from nbfleet.control.fleet.view import export_gauges
from nbfleet.control.hosts import draining_hosts
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.resources import HostInventory
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.decisions import Migrated

if TYPE_CHECKING:
    from nbfleet.control.platform import Platform

log = logging.getLogger(__name__)

#: A cell the agent no longer reports, and older than this, has ended unseen.
UNREPORTED_GRACE_S = 5.0
#: How often running cells are checked against their agents' reports.
REAP_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    """The scheduler's answer for a GPU workspace that needs a host: its hosts, or
    why it waits, or why it never can run."""

    hosts: tuple[str, ...] = ()
    reserved: tuple[int, ...] = ()
    waiting: str | None = None
    refused: str | None = None


class FleetService:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.scheduler: LiveScheduler | None = None
        self.token: int | None = None
        self.gates = GateRegistry()
        self._host_urls: dict[str, str] = {}
        self._missing_placed: set[str] = set()
        #: Hosts an admin drains, as of the last pass (``control/drain.py``).
        self._admin_draining: set[str] = set()
        self._last_tick = self._last_reap = self._last_report = float("-inf")
        #: No autoscaler pass before this (scheduler clock): see ``take_over``.
        self._scale_from = float("inf")
        self.meter: CellMeter | None = None
        self.scaler = Scaler(platform, None)
        self._meters_opened = 0
        self._prewarms: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------- the policy
    def new_policy(self, hosts: Sequence[tuple[str, HostInventory]]) -> FleetPolicy:
        """The configured policy, sized for these hosts (``sizing.py``)."""
        static = self.scaler.static_hosts((h for h, _ in hosts), self._admin_draining)
        return sized_policy(self.platform.config.fleet, [inv for _, inv in hosts], static)

    def use_provider(self, provider: HostProvider | None) -> None:
        """Hosts on demand: the autoscaler's decisions are carried out through it."""
        self.scaler = Scaler(self.platform, provider)

    async def aclose(self) -> None:
        for task in list(self._prewarms):
            task.cancel()
        await self.scaler.aclose()
        if self.meter is not None:
            await self.meter.aclose()

    # ------------------------------------------------------------- the lease
    async def take_over(self, token: int) -> None:
        """This replica now holds the lease: rebuild the model from the facts."""
        fleet, kernels = await asyncio.to_thread(facts.placed, self.platform)
        self._host_urls = {host_id: url for host_id, _, url in fleet}
        # Hosts kernels are placed on that this rebuild could not count (not alive):
        # if one comes back, the model is rebuilt with it (``sync_hosts``).
        self._missing_placed = {h for k in kernels for h in k.host_ids} - set(self._host_urls)
        cells = await facts.reported_cells(self.platform, fleet)
        policy = self.new_policy([(h, inv) for h, inv, _ in fleet])
        if self.meter is not None:
            await self.meter.aclose()
        self.meter = CellMeter(self.platform.db, self.platform.jobs.prices, policy.billing)
        effects = _Effects(self)
        scheduler = effects.scheduler = LiveScheduler(policy, effects=effects)
        if self.scheduler is not None:  # one decision log across rebuilds
            scheduler.log, scheduler.logged = self.scheduler.log, self.scheduler.logged
        refused = scheduler.rebuild([(h, inv) for h, inv, _ in fleet], kernels, cells)
        for cell in cells:
            if cell.task_id not in refused:
                self.meter.adopt(cell.task_id, len(cell.gpu_indices), cell.ran_s)
        if refused:
            log.warning("rebuild refused %d reported cells (unknown or conflicting): %s",
                        len(refused), refused[:10])
        old, self.scheduler, self.token = self.scheduler, scheduler, token
        # Hosts that are alive but have not announced themselves to this replica yet
        # (a fresh start, or a lease taken over) would look missing to the autoscaler
        # and be replaced: its first pass waits one heartbeat-expiry window.
        self._scale_from = scheduler.now() + self.platform.config.agent_timeout_s
        if old is not None:
            for task in list(old.queue()):
                old.cancel(task[0].id)
        log.info("fleet scheduler (%s) rebuilt: %d hosts, %d GPU kernels, %d running cells",
                 self.platform.config.fleet.policy, len(fleet), len(kernels),
                 len(cells))

    def stand_down(self) -> None:
        """Another replica holds the lease: stop deciding (waiting cells are told)."""
        scheduler, self.scheduler, self.token = self.scheduler, None, None
        if scheduler is not None:
            for task, _ in scheduler.queue():
                scheduler.cancel(task.id)

    # ---------------------------------------------------------------- ledger
    async def admit(self, binding: Binding, on_refused: Callable[[str], None]) -> str | None:
        """Meter a cell that got its GPUs; the reason it may not run, or None."""
        meter = self.meter
        if meter is None:
            return "the GPU scheduler is restarting; run the cell again"
        return await meter.admit(binding.task_id, binding.workspace_id, binding.gpu_type,
                                 len(binding.gpu_indices), on_refused)

    def _meter_kernels(self, scheduler: LiveScheduler, meter: CellMeter) -> None:
        """What each kernel pays for itself: its standby replicas, or its reservation."""
        policy = scheduler.policy
        for kernel in policy.kernels.values():
            if not kernel.hosts or kernel.hosts[0] not in policy.hosts:
                continue
            first = policy.hosts[kernel.hosts[0]]
            gpu_type = next((g.gpu_type for g in first.gpus if g.satisfies(kernel.spec)), "")
            if policy.billing == "reserved":
                billed = len(first.bound(kernel.id))
            else:
                executing = kernel.running is not None and kernel.last_executor in kernel.hosts
                billed = (len(kernel.hosts) - int(executing)) * kernel.spec.gpus
            if kernel.id not in meter.kernels_metered():
                self._meters_opened += 1
            meter.kernel_gpus(kernel.id, f"{self.platform.instance_id}.{self._meters_opened}",
                              gpu_type, billed)

    # ---------------------------------------------------------------- events
    def place(self, workspace_id: str, spec: ResourceSpec, tenant: str = "",
              weight: float = 1.0) -> GpuPlacement:
        """Open (or look up) the workspace's kernel in the policy (idempotent);
        ``tenant`` (its project) and ``weight`` place its cells in the fair queue."""
        scheduler = self.scheduler
        if scheduler is None:
            return GpuPlacement(waiting="the GPU scheduler is starting")
        try:
            placed = scheduler.open_kernel(workspace_id, spec, tenant, weight)
        except CellRefused as refused:
            return GpuPlacement(refused=refused.reason)
        if placed is None:
            kinds = " or ".join(spec.gpu_types) or "GPU"
            reason = f"waiting for a host with room for {spec.gpus}x {kinds}"
            if scheduler.policy.provisioning:
                reason += "; a host is being added"
            return GpuPlacement(waiting=reason)
        return GpuPlacement(placed, scheduler.reserved_gpus(workspace_id))

    def close(self, workspace_id: str) -> None:
        """The workspace's runtime is gone (suspended, deleted): drop its kernel."""
        if self.scheduler is not None:
            self.scheduler.close_kernel(workspace_id)

    async def sync_hosts(self) -> None:
        """Feed the scheduler the hosts that joined or died since the last pass."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        alive_hosts = await asyncio.to_thread(facts.alive_hosts, self.platform)
        alive = {host_id for host_id, _, _ in alive_hosts}
        self.scaler.forget_gone(alive)
        by_admin = await asyncio.to_thread(self._drained_by_admin)
        # Undrained while it runs: its cells left the model with it (``_drain_pass``),
        # and would share their GPUs with new cells if it simply joined again.
        undrained = (self._admin_draining - by_admin) & alive
        self._admin_draining = by_admin
        draining = self.scaler.draining | by_admin
        returned = []
        for host_id, inventory, url in alive_hosts:
            self._host_urls[host_id] = url
            if host_id not in scheduler.policy.hosts and host_id not in draining:
                if host_id in self._missing_placed or host_id in undrained:
                    returned.append(host_id)
                else:
                    scheduler.host_joined(host_id, inventory)
        if returned and self.token is not None:
            # A host the model's kernels are placed on, missing from the last rebuild
            # (its heartbeats had lapsed while no control plane ran, or it was being
            # drained): rebuild with it, so the cells its agent reports running hold
            # their GPUs again. The pass goes on with the new model: a host still
            # draining leaves it again below, before any placement can choose it (the
            # reconciler runs this under its fleet-model lock).
            log.info("hosts %s came back with placed kernels or cells: rebuilding", returned)
            await self.take_over(self.token)
            if self.scheduler is None:
                return
            scheduler = self.scheduler
        self.scaler.settle_provisioning(scheduler)
        for host_id in [h for h in scheduler.policy.hosts if h not in alive]:
            lost = scheduler.host_lost(host_id)
            if lost:
                log.warning("host %s lost with %d cells running", host_id, len(lost))
        for host_id in sorted(draining - self.scaler.draining):
            await self._drain_pass(scheduler, host_id, host_id in alive)
        await self._fit_to_fleet(scheduler, alive_hosts)

    def _drained_by_admin(self) -> set[str]:
        with self.platform.db.transaction(write=False) as session:
            return draining_hosts(session)

    async def _drain_pass(self, scheduler: LiveScheduler, host_id: str, alive: bool) -> None:
        """A host marked draining (``control/drain.py``) leaves the model as a host
        the autoscaler releases does (the policy moves its kernels' replicas), and
        its workspaces are asked to leave; repeated each pass until it is empty.
        The model forgets GPU cells running there as at a lost host; the cells
        themselves are then handled by each workspace's suspend (its move), as any
        suspend handles a busy kernel (``--suspend-on-busy``)."""
        if host_id in scheduler.policy.hosts:
            lost = scheduler.host_lost(host_id)
            log.info("host %s is draining: out of the model (%d cells running there)",
                     host_id, len(lost))
        if alive:
            await self.send_away(host_id, scheduler)

    async def send_away(self, host_id: str, scheduler: LiveScheduler | None) -> int | None:
        """Ask every workspace on a leaving host (an admin's drain, an autoscaler's
        release) to go, under this replica's lease: how many are still there; None
        when this replica is not in charge (``drain.empty_host``)."""
        if self.token is None:
            return None
        left = await asyncio.to_thread(empty_host, self.platform.db, host_id,
                                       Homes.of(scheduler, host_id), self.token,
                                       self.platform.config.agent_timeout_s)
        if left:
            self.platform.wake()
        return left

    async def _fit_to_fleet(self, scheduler: LiveScheduler,
                            alive: Sequence[facts.HostFact]) -> None:
        """More hosts than the policy was sized for (agents that registered after a
        fresh start): rebuild it from the facts. Otherwise keep the autoscaler's
        floor at the hosts it cannot stop."""
        fleet = [inv for _, inv, _ in alive]
        if self.token is not None and outgrown(scheduler.policy, self.platform.config.fleet,
                                               fleet):
            log.info("the fleet outgrew the policy's sizing (%d hosts): rebuilding", len(fleet))
            await self.take_over(self.token)
            return
        wanted = self.new_policy([(h, inv) for h, inv, _ in alive]).config.autoscaler.min_hosts
        config = scheduler.policy.config
        if config.autoscaler.min_hosts != wanted:
            scheduler.policy.config = replace(
                config, autoscaler=replace(config.autoscaler, min_hosts=wanted))

    def prewarm(self, scheduler: LiveScheduler, host_id: str, count: int) -> None:
        """``scheduler``'s policy wants ``count`` more warm containers on the host:
        grow the agent's warm pool to the policy's figure for it, and tell the
        policy when they are ready (``prewarmed``), as the simulator does after a
        start. (A rebuild asks before its scheduler is the service's.)"""
        task = asyncio.get_running_loop().create_task(self._prewarm(scheduler, host_id, count))
        self._prewarms.add(task)
        task.add_done_callback(self._prewarms.discard)

    async def _prewarm(self, scheduler: LiveScheduler, host_id: str, count: int) -> None:
        policy = scheduler.policy
        target = policy.warm.get(host_id, 0) + policy.warming.get(host_id, 0)
        ready = await warm_pool_ready(self.platform, host_id, self._host_urls.get(host_id),
                                      target)
        if ready and self.scheduler is scheduler and host_id in scheduler.policy.hosts:
            scheduler.prewarmed(host_id, count)

    def released(self, agent_id: str, task_ids: Sequence[str],
                 held: Sequence[str] = ()) -> int:
        """An agent reports cells that ended; only that host's cells are released.
        ``held``: ended with a GPU still open, so not released (``LiveScheduler.held``)."""
        scheduler = self.scheduler
        if scheduler is None:
            return 0
        for task_id in held:
            cell = scheduler.running.get(task_id)
            if cell is not None and cell.binding.host_id == agent_id:
                scheduler.held(task_id)
        count = 0
        for task_id in task_ids:
            cell = scheduler.running.get(task_id)
            if cell is not None and cell.binding.host_id == agent_id:
                scheduler.release(task_id)
                count += 1
        return count

    async def reap_unreported(self) -> int:
        """Release cells whose agent no longer reports them (their end was missed:
        the connection closed mid-cell and the agent's report was lost)."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.running:
            return 0
        by_host: dict[str, list[str]] = {}
        now = scheduler.now()
        for task_id, cell in scheduler.running.items():
            # A cell not delivered yet (its kernel is moving) is not the agent's to report.
            if cell.delivered_at is not None and now - cell.delivered_at > UNREPORTED_GRACE_S:
                by_host.setdefault(cell.binding.host_id, []).append(task_id)
        reaped = 0
        for host_id, task_ids in by_host.items():
            url = self._host_urls.get(host_id)
            report = await facts.agent_bindings(self.platform, url) if url else None
            if report is None or self.scheduler is not scheduler:
                continue
            reported = {a.binding.task_id for a in report.bindings}
            for task_id in task_ids:
                if task_id not in reported and task_id in scheduler.running:
                    log.warning("cell %s on %s is no longer reported by its agent: its "
                                "GPUs are released", task_id, host_id)
                    scheduler.release(task_id)
                    reaped += 1
        return reaped

    async def periodic(self) -> None:
        """The reconciler's tick: the autoscaler at its interval, and the search for
        cells whose end was missed."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        now = scheduler.now()
        if (now >= self._scale_from
                and now - self._last_tick >= scheduler.policy.config.autoscaler.interval_s):
            self._last_tick = now
            scheduler.tick()
        export_gauges(scheduler)
        if now - self._last_report >= self.platform.config.meter_interval_s and self.meter:
            self._last_report = now
            self._meter_kernels(scheduler, self.meter)
            await self.meter.report()
        if now - self._last_reap >= REAP_EVERY_S:
            self._last_reap = now
            await self.reap_unreported()


class _Effects:
    """Decisions carried out: hosts through the provider, placements through the
    reconciler, cells' ends into the ledger. What cannot be carried out yet is
    logged, never pretended."""

    def __init__(self, service: FleetService) -> None:
        self.service = service
        #: The scheduler these effects serve (set once it exists).
        self.scheduler: LiveScheduler | None = None

    def cell_ended(self, task_id: str) -> None:
        if self.service.meter is not None:
            self.service.meter.end(task_id)

    def kernel_closed(self, workspace_id: str) -> None:
        if self.service.meter is not None:
            self.service.meter.kernel_closed(workspace_id)

    def scale_out(self, count: int, reason: str) -> None:
        self.service.scaler.scale_out(count, reason)

    def scale_in(self, host_ids: tuple[str, ...]) -> None:
        self.service.scaler.scale_in(host_ids)

    def prewarm(self, host_id: str, count: int) -> None:
        if self.scheduler is not None:
            self.service.prewarm(self.scheduler, host_id, count)

    def placements_changed(self) -> None:
        self.service.platform.wake()

    def migrate(self, move: Migrated) -> None:
        # Carried out elsewhere: a move for a task when the cell binds there (the
        # cell gate moves the kernel), an evacuation by the scaler's drain.
        log.info("%s moves from %s to %s (%s)", move.kernel_id, move.from_host, move.to_host,
                 "with its cell" if move.for_task else "emptying the host")

