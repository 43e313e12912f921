"""The workspace reconciler: drives each workspace's state towards its desired state.

Each step is (1) a short transaction that enters the step's transitional state and
records where it will act, (2) idempotent calls to an agent, and (3) a short
transaction that settles the state. A crash anywhere leaves a state from which
:func:`nbfleet.model.workspace.plan` picks the same step again, so re-running is
always safe. Only the holder of the ``workspace-reconciler`` lease runs, and it
re-checks its fencing token in every transaction it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from prometheus_client import Counter
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import failover, hosts, leases
from nbfleet.control.collection import after_suspend
from nbfleet.control.fleet.service import GpuPlacement
from nbfleet.control.host_choice import cpu_host, gpu_host
from nbfleet.control.platform import Platform
from nbfleet.control.step_results import Work, record
from nbfleet.control.workspaces import FleetShapes, resources_of, transition
from nbfleet.db.tables import Kernel, Project, Workspace
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.errors import DomainError, NotFound, SuspendFailed
from nbfleet.model.workspace import (
    Action,
    DesiredState,
    WorkspaceState,
    plan,
    retry_delay_s,
)
from nbfleet.protocol.agent import RuntimePlaced, RuntimeSuspended

log = logging.getLogger(__name__)

LEASE = leases.WORKSPACES
BATCH = 100
#: Workspaces reconciled at once. Most of a step is waiting on an agent (a resume
#: restoring state), so this bounds calls in flight, not CPU: a burst of resumes
#: must not queue behind each other (8 made 32 resumes take four rounds).
PARALLEL = 64
MAX_STEPS = 8
#: The lease and the fleet's periodic work are seen to at most this often (a tick
#: woken sooner only dispatches); well within the lease's time to live.
DUTIES_EVERY_S = 0.25

STEPS = Counter("nbfleet_reconcile_steps_total", "Reconciler steps", ["action", "outcome"])


class LeaseLost(Exception):
    """Another replica took the lease: stop writing."""


@dataclass(frozen=True, slots=True)
class NeedsGpuPlacement:
    """The workspace needs a host and asks for GPUs: the scheduler decides where."""

    workspace_id: str
    spec: ResourceSpec
    #: Whose cells these are in the fair queue: the project, and its weight.
    tenant: str
    weight: float


class Reconciler:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.db = platform.db
        self.token: int | None = None
        fleet = platform.config.fleet
        #: The registered hosts' shapes: whether a refused GPU placement waits or fails.
        self._shapes = FleetShapes(fleet.host_gpus, fleet.max_hosts)
        self._slots = asyncio.Semaphore(PARALLEL)
        #: Held while the fleet's model may be rebuilt from the database (the duties)
        #: and from a GPU placement's choice until the database records it: a rebuild
        #: in between would forget a placement that is then carried out.
        self._fleet_model = asyncio.Lock()
        #: When this replica took the lease (DB clock): see ``_mark_dead_hosts``.
        self._in_charge_since: datetime | None = None
        #: Workspaces being reconciled, each by a task of its own: a tick starts the
        #: newly due ones at once instead of waiting for the slowest of the last.
        self._running: dict[str, asyncio.Task[None]] = {}
        #: Due again while their task ran: looked at again as soon as it ends.
        self._again: set[str] = set()
        self._duties_at = float("-inf")
        #: The last tick was woken too soon after the duties to run them again.
        self._duties_skipped = False

    async def run_forever(self) -> None:
        wake = self.platform.bind_loop()
        interval = self.platform.config.reconcile_interval_s
        try:
            while True:
                wake.clear()  # before the tick: a request arriving during it is not lost
                try:
                    await self.tick()
                except Exception:
                    log.exception("reconciler tick failed")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._next_wait(interval)):
                        await wake.wait()
        finally:
            running = list(self._running.values())
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _next_wait(self, interval: float) -> float:
        """Until the next tick: ``interval``, or sooner when this tick was woken but
        skipped the duties (run at most every DUTIES_EVERY_S): what woke it (a drain,
        a placement change) may need them, and waiting a whole interval made a drain
        start up to a second late."""
        if not self._duties_skipped:
            return interval
        return min(interval, max(0.01, DUTIES_EVERY_S - (time.monotonic() - self._duties_at)))

    async def tick(self) -> None:
        """The lease and the fleet's duties, then a task for each newly due workspace.
        A burst of requests wakes the loop dozens of times a second: the duties (two
        writes among them) run at most every DUTIES_EVERY_S, the dispatch each time."""
        stale = self.token is None or time.monotonic() - self._duties_at >= DUTIES_EVERY_S
        self._duties_skipped = not stale
        if stale and not await self._duties():
            return
        due = await asyncio.to_thread(self._due)
        for ws_id in due:
            if ws_id in self._running:
                self._again.add(ws_id)  # its task may have read the row before the change
                continue
            task = asyncio.create_task(self._reconcile_guarded(ws_id))
            self._running[ws_id] = task
            task.add_done_callback(functools.partial(self._ended, ws_id))

    async def _duties(self) -> bool:
        """Take or renew the lease and do the fleet's periodic work; False when
        another replica holds the lease."""
        config = self.platform.config
        self.token = await asyncio.to_thread(
            leases.acquire, self.db, LEASE, self.platform.instance_id, config.lease_ttl_s
        )
        fleet = self.platform.fleet
        if self.token is None:
            fleet.stand_down()
            return False
        self._duties_at = time.monotonic()
        async with self._fleet_model:
            if fleet.token != self.token:
                self._in_charge_since = None
                await fleet.take_over(self.token)
            await asyncio.to_thread(self._mark_dead_hosts)
            await fleet.sync_hosts()
            await fleet.periodic()
        self.platform.standbys.kick()
        return True

    def _ended(self, workspace_id: str, _task: asyncio.Task[None]) -> None:
        self._running.pop(workspace_id, None)
        if workspace_id in self._again:
            self._again.discard(workspace_id)
            self.platform.wake()

    def _holds_lease(self, session: Session) -> bool:
        return self.token is not None and leases.still_held(session, LEASE, self.token)

    def _check_lease(self, session: Session) -> None:
        if not self._holds_lease(session):
            raise LeaseLost()

    def _mark_dead_hosts(self) -> None:
        """Hosts whose heartbeats stopped lose their runtimes, but only once this
        replica has been in charge for a whole timeout: after a control-plane restart
        (or while no replica was up) heartbeats failed because of us, not the hosts,
        and a restart slower than the timeout would otherwise re-place every
        workspace and lose its running cells."""
        timeout = self.platform.config.agent_timeout_s
        with self.db.transaction() as session:
            self._check_lease(session)
            now = self.db.now(session)
            if self._in_charge_since is None:
                self._in_charge_since = now
            if (now - self._in_charge_since).total_seconds() < timeout:
                return
            for host_id in hosts.dead_hosts_with_runtimes(session, now, timeout):
                lost = hosts.runtimes_lost(session, host_id, now, "host stopped heartbeating")
                log.warning("host %s is dead; %d workspaces will be re-placed", host_id, lost)

    def _due(self) -> list[str]:
        with self.db.transaction(write=False) as session:
            now = self.db.now(session)
            query = (
                select(Workspace.id)
                .where(Workspace.pending.is_(True))
                .where((Workspace.next_attempt_at.is_(None)) | (Workspace.next_attempt_at <= now))
                .order_by(Workspace.updated_at)
                .limit(BATCH)
            )
            return list(session.execute(query).scalars())

    async def _reconcile_guarded(self, workspace_id: str) -> None:
        async with self._slots:
            try:
                await self.reconcile(workspace_id)
            except LeaseLost:
                log.info("lease lost while reconciling %s", workspace_id)
            except Exception:
                log.exception("reconciling %s failed", workspace_id)

    async def reconcile(self, workspace_id: str) -> None:
        """Take steps until the workspace settles, a step fails, or the budget runs out."""
        for _ in range(MAX_STEPS):
            work = await asyncio.to_thread(self._begin, workspace_id)
            if isinstance(work, NeedsGpuPlacement):
                async with self._fleet_model:
                    fleet = self.platform.fleet
                    placement = fleet.place(work.workspace_id, work.spec, work.tenant,
                                            work.weight)
                    if placement.refused is not None and self.token is not None:
                        # Hosts reach the model at the duties' pace: one that joined
                        # since may be the one that fits. Fed it, ask again before the
                        # workspace fails for good.
                        await fleet.sync_hosts()
                        placement = fleet.place(work.workspace_id, work.spec, work.tenant,
                                                work.weight)
                    work = await asyncio.to_thread(self._begin, workspace_id, placement)
            if not isinstance(work, Work):
                return
            try:
                result = await self._act(work)
            except LeaseLost:
                raise
            except Exception as exc:
                STEPS.labels(work.step.action, "error").inc()
                await asyncio.to_thread(self._fail, work, exc)
                self.platform.notify_changed(workspace_id)
                return
            STEPS.labels(work.step.action, "ok").inc()
            if isinstance(result, RuntimeSuspended) and not work.moving:
                # A move is not kept waiting for it: the next suspend collects.
                await after_suspend(self.db, self.platform.blobs, work, result,
                                    self._holds_lease)
            more = await asyncio.to_thread(self._finish, work, result)
            if work.gpus and work.step.action is not Action.PLACE and not work.moving:
                self.platform.fleet.close(work.workspace_id)  # its runtime is gone
            self.platform.notify_changed(workspace_id)
            if not more:
                return

    # ----------------------------------------------------------- transactions
    def _begin(self, workspace_id: str,
               gpu: GpuPlacement | None = None) -> Work | NeedsGpuPlacement | None:
        config = self.platform.config
        with self.db.transaction() as session:
            self._check_lease(session)
            now = self.db.now(session)
            ws = session.get(Workspace, workspace_id, with_for_update=True)
            if ws is None:
                return None
            if ws.next_attempt_at is not None and ws.next_attempt_at > now:
                return None
            step = plan(WorkspaceState(ws.state), DesiredState(ws.desired_state))
            if step is None:
                ws.pending = False
                return None
            if step.enter is not None:
                transition(session, ws, step.enter, now, f"{step.action} requested")
            host = hosts.alive_agent(session, ws.host_id, now, config.agent_timeout_s)
            if host is not None and host.boot_id != ws.host_boot_id:
                host = None  # that boot's runtime is gone
            if step.action is Action.PLACE and host is not None and host.draining_since:
                host = None  # a retried placement does not go back to a draining host
            spec = resources_of(ws)
            if step.action is Action.PLACE and host is None and spec.gpus:
                if gpu is None:
                    project = session.get(Project, ws.project_id)
                    return NeedsGpuPlacement(ws.id, spec, ws.project_id,
                                             project.job_weight if project else 1.0)
                host = gpu_host(session, ws, gpu, now, config.agent_timeout_s, self._shapes)
                if host is None:
                    return None
            if step.action is Action.PLACE and host is None:
                host = cpu_host(session, ws, now, config.agent_timeout_s)
                if host is None:
                    return None
            kernels = tuple(
                (k.id, k.name)
                for k in session.execute(
                    select(Kernel).where(Kernel.workspace_id == ws.id).order_by(Kernel.created_at)
                ).scalars()
            )
            limits = network = None
            if step.action is Action.PLACE:
                project = session.get(Project, ws.project_id)
                if project is not None:
                    limits, network = project.kernel_limits, project.kernel_network
            placing = step.action is Action.PLACE and host is not None
            notices = (failover.notices(ws.snapshot, [kid for kid, _ in kernels], host.id)
                       if placing and host is not None else {})
            return Work(ws.id, step, ws.generation, WorkspaceState(ws.state),
                        host.url if host else None, kernels, ws.snapshot, limits, network,
                        spec.gpus, ws.move_to is not None, notices)

    def _finish(self, work: Work, result: RuntimePlaced | RuntimeSuspended | None) -> bool:
        """Settle the step; True if the workspace still has work to do."""
        with self.db.transaction() as session:
            self._check_lease(session)
            now = self.db.now(session)
            ws = session.get(Workspace, work.workspace_id, with_for_update=True)
            if ws is None or ws.state != work.expect_state:
                return False
            done = f"{work.step.action} done"
            if work.step.action is Action.PLACE:
                # After a lost host: what it came back to, and what was rolled back.
                back = failover.rolled_back(work.snapshot, [kid for kid, _ in work.kernels])
                done = f"{done}: {back}" if back else done
            transition(session, ws, work.step.done, now, done)
            if work.step.action is Action.PLACE:
                ws.placed_generation = work.generation
            if result is not None:
                record(ws, work, result, now)
            if work.step.action is not Action.PLACE:
                ws.host_id = ws.host_boot_id = None
                ws.gpu_placement = None
            if work.step.action is Action.DESTROY:
                for kernel in session.execute(
                    select(Kernel).where(Kernel.workspace_id == ws.id)
                ).scalars():
                    session.delete(kernel)
            ws.attempts = 0
            ws.last_error = None
            ws.next_attempt_at = None
            return ws.pending

    def _fail(self, work: Work, exc: Exception) -> None:
        message = exc.detail if isinstance(exc, DomainError) else repr(exc)
        log.warning("%s of %s failed: %s", work.step.action, work.workspace_id, message)
        with self.db.transaction() as session:
            self._check_lease(session)
            now = self.db.now(session)
            ws = session.get(Workspace, work.workspace_id, with_for_update=True)
            if ws is None or ws.state != work.expect_state:
                return
            ws.last_error = f"{work.step.action} failed: {message}"[:2000]
            if isinstance(exc, SuspendFailed):
                # Nothing was released: the workspace runs on, and says why it did not
                # suspend. It is not retried behind the user's back.
                ws.desired_state = DesiredState.RUNNING
                transition(session, ws, WorkspaceState.RUNNING, now, ws.last_error)
                moving, ws.move_to = ws.move_to is not None, None
                if moving:
                    # A drain asks again after a backoff, not at its next pass (0.25 s):
                    # a kernel that will not suspend must not be hammered.
                    ws.attempts += 1
                    ws.next_attempt_at = now + timedelta(seconds=retry_delay_s(ws.attempts))
                else:
                    ws.attempts, ws.next_attempt_at = 0, None
                return
            ws.attempts += 1
            delay = retry_delay_s(ws.attempts) * random.uniform(0.5, 1.0)
            ws.next_attempt_at = now + timedelta(seconds=delay)
            if work.step.action is Action.PLACE:
                transition(session, ws, WorkspaceState.FAILED, now, ws.last_error)

    # --------------------------------------------------------------- actions
    async def _act(self, work: Work) -> RuntimePlaced | RuntimeSuspended | None:
        agents = self.platform.agents
        config = self.platform.config
        if work.step.action is Action.PLACE:
            assert work.host_url is not None
            return await agents.ensure_runtime(
                work.host_url, work.workspace_id, work.generation, list(work.kernels),
                work.snapshot, work.limits, work.network, work.gpus, work.notices,
            )
        result: RuntimeSuspended | None = None
        if work.host_url is not None:
            try:
                if work.step.action is Action.RELEASE:
                    result = await agents.suspend_runtime(
                        work.host_url, work.workspace_id, work.generation,
                        config.suspend_on_busy, config.suspend_busy_timeout_s)
                else:
                    await agents.release_runtime(work.host_url, work.workspace_id,
                                                 work.generation)
            except NotFound as exc:  # nothing there to release; a stale refusal is retried
                log.info("release of %s: %s", work.workspace_id, exc.detail)
        if work.step.action is Action.DESTROY:
            await asyncio.to_thread(self.platform.files.delete_all, work.workspace_id)
        return result
