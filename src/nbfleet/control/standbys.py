"""Standby replicas of GPU workspaces: made, kept in sync, and dropped.

A replica policy (``notebookos``, ``nbfleet`` with ``--replicas`` over 1) gives a
GPU workspace's kernel several hosts; the runtime runs on one of them (the
executor). On each of the others this keeper makes a standby
(``agent/standbys.py``): the kernel started there with the state of the
executor's last checkpointed cell staged on that host's disk. Every checkpoint
the control plane records (``failover.record_checkpoint``) is sent on to the
standbys, off the cell's path, one at a time per standby (a newer one replaces
one still waiting). A placement on a host with a standby promotes it; the
reconciler prefers such a host (:func:`hosts_with_standbys`).

The database is the one record of which standbys exist (``standby_replicas``):
a standby is known by its host's boot, so one on a host that restarted (or that
died) is made again elsewhere or dropped. Passes run in the reconciler's duties,
in the lease holder only; a pass reads the running GPU workspaces (a few per
host) and the standby rows, and acts on the differences only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram
from sqlalchemy import delete, select

from nbfleet.control import hosts
from nbfleet.db.tables import Agent, Kernel, Project, StandbyReplica, Workspace
from nbfleet.model.errors import DomainError
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.protocol.checkpoints import StandbyState

if TYPE_CHECKING:
    from nbfleet.control.platform import Platform

log = logging.getLogger(__name__)

STANDBY_SYNC = Histogram(
    "nbfleet_standby_sync_seconds",
    "From a checkpoint recorded to a standby replica having it staged",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

#: A pass at most this often (the reconciler's duties run every 0.25 s).
PASS_EVERY_S = 1.0
#: Standbys made at once (each starts kernels on its host).
PARALLEL = 8
#: The longest wait before a standby that could not be made is tried again.
BACKOFF_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class Want:
    workspace_id: str
    host_id: str
    host_url: str
    boot_id: str
    generation: int
    kernels: tuple[tuple[str, str], ...]
    snapshot: dict[str, Any] | None
    limits: dict[str, Any] | None
    network: str | None
    gpus: int


@dataclass
class _Sync:
    """The checkpoints waiting for one standby: kernel id -> (key, cell, recorded at)."""

    generation: int
    waiting: dict[str, tuple[str, int | None, float]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class StandbyKeeper:
    platform: Platform
    #: (workspace, host) -> (failures in a row, not tried again before): a standby
    #: that cannot be made is not made again every pass (each try starts kernels).
    _backoff: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    #: The same for a standby whose stage failed: a pass does not send it the
    #: latest checkpoint again every second (each try may start a kernel). A new
    #: checkpoint is always sent.
    _stage_backoff: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    _last_pass: float = float("-inf")
    _pass: asyncio.Task[None] | None = None
    _syncs: dict[tuple[str, str], _Sync] = field(default_factory=dict)

    async def aclose(self) -> None:
        """Shutting down: the pass and the syncs in flight stop."""
        tasks = [t for t in (self._pass, *(s.task for s in self._syncs.values()))
                 if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ the passes
    def kick(self) -> None:
        """From the reconciler's duties: start a pass unless one runs or ran lately."""
        if self._pass is not None and not self._pass.done():
            return
        if time.monotonic() - self._last_pass < PASS_EVERY_S:
            return
        self._last_pass = time.monotonic()
        self._pass = asyncio.create_task(self._guarded_pass(), name="standby-pass")

    async def _guarded_pass(self) -> None:
        try:
            await self.run_pass()
        except Exception:
            log.exception("standby pass failed")

    async def run_pass(self) -> None:
        # The scheduler's model, read here on the event loop that owns it: a replica
        # the policy moved or put on a new host since the placement is followed.
        scheduler = self.platform.fleet.scheduler
        model = (None if scheduler is None else
                 {kid: list(k.hosts) for kid, k in scheduler.policy.kernels.items()})
        wanted, stale, lagging = await asyncio.to_thread(self._plan, model)
        for workspace_id, host_id, url in stale:
            if url is not None:
                with contextlib.suppress(DomainError):
                    await self.platform.agents.drop_standby(url, workspace_id)
            await asyncio.to_thread(self._forget, workspace_id, host_id)
        limit = asyncio.Semaphore(PARALLEL)
        now = time.monotonic()
        wanted = [w for w in wanted
                  if self._backoff.get((w.workspace_id, w.host_id), (0, 0.0))[1] <= now]

        async def make(want: Want) -> None:
            async with limit:
                made = await self._make(want)
            _note(self._backoff, (want.workspace_id, want.host_id), made)
        await asyncio.gather(*(make(want) for want in wanted))
        # A standby made after the workspace's last checkpoint was sent on (or that
        # missed one) is brought up to date now, not at the next cell. Read again:
        # a newer checkpoint recorded while the standbys were made is sent already.
        for workspace_id, generation, kernel_id, key, cell in await asyncio.to_thread(
                self._still_latest, lagging):
            await self.checkpointed(workspace_id, generation, kernel_id, key, cell,
                                    catch_up=True)

    def _still_latest(self, lagging: list[tuple[str, int, str, str, int | None]]
                      ) -> list[tuple[str, int, str, str, int | None]]:
        """The checkpoints of ``lagging`` that are still their kernel's latest."""
        if not lagging:
            return []
        with self.platform.db.transaction(write=False) as session:
            latest = {ws.id: (_generation(ws), (ws.snapshot or {}).get("kernels") or {})
                      for ws in session.execute(select(Workspace).where(
                          Workspace.id.in_({item[0] for item in lagging}))).scalars()}
        kept = []
        for workspace_id, generation, kernel_id, key, cell in lagging:
            current_generation, kernels = latest.get(workspace_id, (None, {}))
            saved = kernels.get(kernel_id)
            if current_generation == generation and isinstance(saved, dict) and \
                    (saved.get("key"), saved.get("cell")) == (key, cell):
                kept.append((workspace_id, generation, kernel_id, key, cell))
        return kept

    def _plan(self, model: dict[str, list[str]] | None
              ) -> tuple[list[Want], list[tuple[str, str, str | None]],
                         list[tuple[str, int, str, str, int | None]]]:
        """(standbys to make, standbys to drop with their host's URL, checkpoints a
        standby lacks); ``model``: each kernel's replica hosts in the scheduler
        (None: as placed)."""
        config = self.platform.config
        with self.platform.db.transaction(write=False) as session:
            now = self.platform.db.now(session)
            beating = {a.id: a for a in session.execute(select(Agent).where(
                Agent.last_heartbeat_at >= hosts.alive_since(now, config.agent_timeout_s)
            )).scalars()}
            # A draining host gets no new standby, and its standbys are dropped.
            alive = {h: a for h, a in beating.items() if a.draining_since is None}
            rows = {(r.workspace_id, r.host_id): r for r in session.execute(
                select(StandbyReplica)).scalars()}
            running = list(session.execute(select(Workspace).where(
                Workspace.state == WorkspaceState.RUNNING,
                Workspace.gpu_placement.is_not(None))).scalars())
            kernels: dict[str, list[tuple[str, str]]] = {ws.id: [] for ws in running}
            for ws_id, kernel_id, name in session.execute(
                    select(Kernel.workspace_id, Kernel.id, Kernel.name)
                    .where(Kernel.workspace_id.in_(list(kernels)))
                    .order_by(Kernel.created_at)):
                kernels[ws_id].append((kernel_id, name))
            wanted: list[Want] = []
            keep: set[tuple[str, str]] = set()
            lagging: set[tuple[str, int, str, str, int | None]] = set()
            for ws in running:
                for host_id in _replica_hosts(ws, model):
                    agent = alive.get(host_id)
                    if agent is None:
                        continue
                    keep.add((ws.id, host_id))
                    row = rows.get((ws.id, host_id))
                    # Made again (idempotent on the agent) when the host restarted, or
                    # to follow the workspace's kernels (one started since).
                    if row is None or row.boot_id != agent.boot_id or \
                            set(row.staged or {}) != {kid for kid, _ in kernels[ws.id]}:
                        wanted.append(self._want(session, ws, agent, kernels[ws.id]))
                        continue
                    for kernel_id, saved in ((ws.snapshot or {}).get("kernels") or {}).items():
                        staged = (row.staged or {}).get(kernel_id) or {}
                        # The cell too: a standby made with the latest checkpoint
                        # (its order names keys only) has it with no cell, and the
                        # stage that named the cell may have come before its kernel.
                        if isinstance(saved, dict) and saved.get("key") and (
                                staged.get("key") != saved["key"]
                                or staged.get("cell") != saved.get("cell")):
                            lagging.add((ws.id, _generation(ws), kernel_id,
                                         str(saved["key"]), saved.get("cell")))
            # A workspace on its way to a host (its executor was lost, or it moves for
            # a cell's GPUs) keeps its standbys: the placement promotes one.
            placing = {ws.id for ws in session.execute(select(Workspace).where(
                Workspace.id.in_({ws_id for ws_id, _ in rows}),
                Workspace.desired_state == DesiredState.RUNNING,
                Workspace.state.in_((WorkspaceState.RESUMING, WorkspaceState.SUSPENDING))
            )).scalars()}
            stale = [(ws_id, host_id, beating[host_id].url if host_id in beating else None)
                     for (ws_id, host_id) in rows
                     if (ws_id, host_id) not in keep
                     and not (ws_id in placing and host_id in alive)]
        return wanted, stale, sorted(lagging, key=lambda item: (item[0], item[2]))

    @staticmethod
    def _want(session: Any, ws: Workspace, agent: Agent,
              kernels: list[tuple[str, str]]) -> Want:
        project = session.get(Project, ws.project_id)
        limits = project.kernel_limits if project is not None else None
        network = project.kernel_network if project is not None else None
        gpus = int((ws.resources or {}).get("gpus", 0) or 0)
        return Want(ws.id, agent.id, agent.url, agent.boot_id, _generation(ws),
                    tuple(kernels), ws.snapshot, limits, network, gpus)

    async def _make(self, want: Want) -> bool:
        try:
            state = await self.platform.agents.keep_standby(
                want.host_url, want.workspace_id, want.generation, list(want.kernels),
                want.snapshot, want.limits, want.network, want.gpus)
        except DomainError as exc:
            log.warning("standby of %s on %s not made: %s", want.workspace_id, want.host_id,
                        exc.detail)
            return False
        await asyncio.to_thread(self._record, want.workspace_id, want.host_id, want.boot_id,
                                state, True)
        log.info("standby of %s kept on %s", want.workspace_id, want.host_id)
        return True

    def _record(self, workspace_id: str, host_id: str, boot_id: str | None,
                state: StandbyState, made: bool) -> None:
        with self.platform.db.transaction() as session:
            now = self.platform.db.now(session)
            row = session.get(StandbyReplica, (workspace_id, host_id))
            staged = {kid: k.model_dump(mode="json") for kid, k in state.kernels.items()}
            if row is None:
                if not made or boot_id is None:
                    return  # dropped meanwhile
                session.add(StandbyReplica(workspace_id=workspace_id, host_id=host_id,
                                           boot_id=boot_id, staged=staged, synced_at=now,
                                           created_at=now))
                return
            if made and boot_id is not None:
                row.boot_id = boot_id
            row.staged, row.synced_at = staged, now

    def _forget(self, workspace_id: str, host_id: str) -> None:
        self._syncs.pop((workspace_id, host_id), None)
        self._stage_backoff.pop((workspace_id, host_id), None)
        with self.platform.db.transaction() as session:
            session.execute(delete(StandbyReplica).where(
                StandbyReplica.workspace_id == workspace_id, StandbyReplica.host_id == host_id))

    # ------------------------------------------------------------ the syncs
    async def checkpointed(self, workspace_id: str, generation: int, kernel_id: str,
                           key: str, cell: int | None, *, catch_up: bool = False) -> None:
        """A checkpoint was recorded: send it on to the workspace's standbys (in the
        background: the agent that reported it is answered at once).

        ``catch_up``: a pass sends the latest checkpoint to a standby that lacks it.
        Not to one with a send under way (what it sends may be newer; the next pass
        looks again), nor to one whose last stage failed lately."""
        recorded = time.perf_counter()
        targets = await asyncio.to_thread(self._targets, workspace_id)
        now = time.monotonic()
        for host_id, url in targets:
            sync = self._syncs.get((workspace_id, host_id))
            if catch_up and (
                    (sync is not None and sync.task is not None and not sync.task.done())
                    or self._stage_backoff.get((workspace_id, host_id), (0, 0.0))[1] > now):
                continue
            if sync is None or sync.generation != generation:
                sync = self._syncs[(workspace_id, host_id)] = _Sync(generation)
            sync.waiting[kernel_id] = (key, cell, recorded)
            if sync.task is None or sync.task.done():
                sync.task = asyncio.create_task(self._send(workspace_id, host_id, url, sync))

    def _targets(self, workspace_id: str) -> list[tuple[str, str]]:
        with self.platform.db.transaction(write=False) as session:
            return [(row.host_id, url) for row, url in session.execute(
                select(StandbyReplica, Agent.url).join(Agent, Agent.id == StandbyReplica.host_id)
                .where(StandbyReplica.workspace_id == workspace_id))]

    async def _send(self, workspace_id: str, host_id: str, url: str, sync: _Sync) -> None:
        while sync.waiting:
            kernel_id = next(iter(sync.waiting))
            key, cell, recorded = sync.waiting.pop(kernel_id)
            try:
                state = await self.platform.agents.stage(url, workspace_id, sync.generation,
                                                         kernel_id, key, cell)
            except DomainError as exc:
                log.info("standby of %s on %s not synced: %s", workspace_id, host_id,
                         exc.detail)
                _note(self._stage_backoff, (workspace_id, host_id), False)
                continue
            _note(self._stage_backoff, (workspace_id, host_id), True)
            STANDBY_SYNC.observe(time.perf_counter() - recorded)
            await asyncio.to_thread(self._record, workspace_id, host_id, None, state, False)


def _note(backoff: dict[tuple[str, str], tuple[int, float]], pair: tuple[str, str],
          worked: bool) -> None:
    """Record a try at a standby: a failure waits 2, 4, 8... s (at most
    :data:`BACKOFF_MAX_S`) before the next; a success clears it."""
    if worked:
        backoff.pop(pair, None)
        return
    failures = backoff.get(pair, (0, 0.0))[0] + 1
    backoff[pair] = (failures, time.monotonic() + min(BACKOFF_MAX_S, 2.0 ** failures))


def _generation(ws: Workspace) -> int:
    """The executor's placement's: standbys and their stages carry the generation
    the executor's checkpoints do (a later one may be a request not acted on)."""
    return ws.placed_generation or ws.generation


def _replica_hosts(ws: Workspace, model: dict[str, list[str]] | None) -> list[str]:
    if model is not None and ws.id in model:
        hosts: list[object] = list(model[ws.id])
    else:
        hosts = list((ws.gpu_placement or {}).get("hosts") or [])
    return [h for h in hosts if isinstance(h, str) and h != ws.host_id]


def hosts_with_standbys(session: Any, workspace_id: str, snapshot: dict[str, Any] | None,
                        now: datetime, timeout_s: float) -> list[str]:
    """Hosts holding a standby of the workspace made in their current boot, those
    with every kernel's latest checkpoint staged first."""
    latest = {kid: k.get("key") for kid, k in ((snapshot or {}).get("kernels") or {}).items()}
    found: list[tuple[bool, str]] = []
    for row, agent in session.execute(
            select(StandbyReplica, Agent).join(Agent, Agent.id == StandbyReplica.host_id)
            .where(StandbyReplica.workspace_id == workspace_id)):
        if row.boot_id != agent.boot_id or \
                agent.last_heartbeat_at < hosts.alive_since(now, timeout_s):
            continue
        staged = {kid: k.get("key") for kid, k in (row.staged or {}).items()}
        found.append((staged != latest, row.host_id))
    return [host for _, host in sorted(found)]
