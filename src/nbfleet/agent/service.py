"""The agent process: registers with the control plane, heartbeats, hosts runtimes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from jupyter_client.kernelspec import KernelSpecManager
from pydantic import ValidationError

from nbfleet.agent.bindings import ReleaseQueue
from nbfleet.agent.checkpoints import Checkpointer
from nbfleet.agent.diskwatch import DiskWatch
from nbfleet.agent.jobs import JobRunner
from nbfleet.agent.livesync import DEFAULT_AGENT_TIMEOUT_S, Lease
from nbfleet.agent.output import DEFAULT_OUTPUT_BUFFER_BYTES
from nbfleet.agent.runtimes import RuntimeManager
from nbfleet.agent.sandbox import open_isolation
from nbfleet.agent.sandbox.quota import remove_leftovers
from nbfleet.model.limits import Limits
from nbfleet.model.resources import HostInventory, parse_gpu_spec
from nbfleet.protocol.agent import (
    AttemptBeat,
    AttemptFinish,
    DrainRequest,
    Heartbeat,
    HeartbeatReply,
    HeldRuntime,
    JobDirective,
    JobDirectives,
    JobHeartbeats,
    KernelDeath,
    Registered,
    Registration,
)
from nbfleet.protocol.checkpoints import CellCheckpoint, CheckpointRecorded
from nbfleet.protocol.gpu import ReleasedCells
from nbfleet.protocol.hosts import HostDrainState
from nbfleet.storage.blobs import BlobStore, BlobStoreUnusable
from nbfleet.storage.files import WorkspaceFiles

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 2.0


@dataclass
class AgentConfig:
    control_url: str
    secret: str
    state_dir: str
    gpus: str = ""
    advertise_url: str = ""  # filled in once the listening port is known
    release_delay_s: float = 0.0
    #: Warm kernels kept ready for resumes (0 turns the pool off).
    warm_pool: int = 1
    #: Import sets to keep a prepared warm kernel for (None: as many as ``warm_pool``).
    warm_profiles: int | None = None
    sandbox: str = "auto"  # auto | bwrap | none
    #: Directories kernels must never see besides the agent's own state (e.g. the
    #: control plane's home with its DB and secrets, in embedded mode).
    hidden_paths: list[str] = field(default_factory=list)
    #: Each workspace's memory, CPU, process and disk limits (None: unlimited).
    limits: Limits = field(default_factory=Limits)
    #: A cgroup subtree delegated to this agent (e.g. ``/nbfleet``), for an
    #: unprivileged agent; by default slots go below the agent's own cgroup.
    cgroup_parent: str | None = None
    millicpus: int = field(default_factory=lambda: (os.cpu_count() or 1) * 1000)
    memory_mb: int = field(
        default_factory=lambda: os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    )
    #: Seconds between job heartbeats (progress, usage, log chunks) while jobs run.
    job_heartbeat_s: float = 2.0
    #: Seconds between syncs of the files kernels write to the blob store (0: only
    #: at suspend and release); the recovery point objective is about twice this.
    file_sync_interval_s: float = 2.0
    #: Save each kernel's state to the blob store after every cell (off the reply
    #: path), so a lost host loses no completed cell's variables.
    cell_checkpoints: bool = True
    #: On SIGTERM, seconds to wait for the control plane to move or suspend this
    #: host's workspaces before shutting down anyway (0: shut down at once).
    drain_timeout_s: float = 60.0
    #: Bytes of a kernel's output kept for a client while none is connected; a
    #: connected client may lag twice this behind (``agent.output``).
    output_buffer_bytes: int = DEFAULT_OUTPUT_BUFFER_BYTES


def load_agent_id(state_dir: str) -> str:
    """A host keeps its id across restarts; its boot id changes on every start."""
    os.makedirs(state_dir, exist_ok=True)
    path = os.path.join(state_dir, "agent-id")
    if os.path.exists(path):
        with open(path) as handle:
            return handle.read().strip()
    agent_id = f"host_{secrets.token_hex(8)}"
    with open(path, "w") as handle:
        handle.write(agent_id)
    return agent_id


def local_id(agent_id: str, state_dir: str) -> str:
    """The name of this agent's resources that are shared by the whole machine (its
    socket directory under /tmp, its cgroup, its network namespaces).

    The agent id alone is unique within one fleet only: two fleets on one machine (a
    staging and a production agent, two test clusters) may both have a
    ``host-00001``, and each would sweep and kill the other's kernels as leftovers of
    its own earlier boot. The state directory tells them apart, and stays the same
    across restarts, so a restarted agent still finds its own leftovers.
    """
    digest = hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:8]
    return f"{agent_id}-{digest}"


def heartbeat_reply(response: httpx.Response) -> HeartbeatReply:
    """The reply to a heartbeat that succeeded. An older control plane answers 204
    with no body: its default agent timeout, and no runtime named stale."""
    if response.status_code == 204 or not response.content:
        return HeartbeatReply(agent_timeout_s=DEFAULT_AGENT_TIMEOUT_S)
    return HeartbeatReply.model_validate(response.json())


def kernelspecs() -> dict[str, Any]:
    specs = KernelSpecManager().get_all_specs()
    return {
        name: {"name": name, "spec": info["spec"], "resources": {}}
        for name, info in specs.items()
    }


class ControlReporter:
    """The job runner's reports, over the agent's authenticated client."""

    def __init__(self, http: httpx.AsyncClient, agent_id: str, boot_id: str) -> None:
        self._http = http
        self._agent_id, self._boot_id = agent_id, boot_id

    async def heartbeat(self, attempts: list[dict[str, Any]]) -> list[JobDirective]:
        body = JobHeartbeats(agent_id=self._agent_id, boot_id=self._boot_id,
                             attempts=[AttemptBeat.model_validate(a) for a in attempts])
        response = await self._http.post("/internal/jobs/heartbeats",
                                         json=body.model_dump(mode="json"))
        response.raise_for_status()
        return JobDirectives.model_validate(response.json()).directives

    async def finish(self, job_id: str, attempt: int, facts: dict[str, Any]) -> bool:
        body = AttemptFinish.model_validate(
            {"agent_id": self._agent_id, "boot_id": self._boot_id, **facts})
        response = await self._http.post(f"/internal/jobs/{job_id}/attempts/{attempt}/finish",
                                         json=body.model_dump(mode="json"))
        if response.status_code in (404, 409):
            return False  # the control plane has moved on from this attempt
        response.raise_for_status()
        return True

    async def checkpoint(self, workspace_id: str, generation: int, kernel_id: str,
                         saved: dict[str, Any], cell: int) -> CheckpointRecorded:
        body = CellCheckpoint(agent_id=self._agent_id, boot_id=self._boot_id,
                              generation=generation, kernel_id=kernel_id, key=saved["key"],
                              bytes=saved["bytes"], written=saved["written"], cell=cell,
                              failed=saved.get("failed"))
        response = await self._http.post(f"/internal/workspaces/{workspace_id}/checkpoints",
                                         json=body.model_dump(mode="json"))
        if response.status_code == 404:
            return CheckpointRecorded(kept=False, reason="the workspace is gone")
        response.raise_for_status()
        return CheckpointRecorded.model_validate(response.json())

    async def released(self, task_ids: list[str], held: list[str]) -> None:
        """Tell the control plane these cells' GPU bindings ended (``held``: with a
        GPU still open in the slot); raises to be retried."""
        body = ReleasedCells(agent_id=self._agent_id, task_ids=task_ids, held=held)
        response = await self._http.post(f"/internal/agents/{self._agent_id}/released",
                                         json=body.model_dump(mode="json"))
        if response.status_code == 404:
            return  # it knows nothing of them (or of us): nothing to do
        if response.status_code in (400, 413, 422):
            # Sent again it would be refused again, and hold back every later report.
            log.error("the control plane refused a GPU release report (%d): %s",
                      response.status_code, response.text[:500])
            return
        response.raise_for_status()


class AgentService:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.agent_id = load_agent_id(config.state_dir)
        self.boot_id = f"boot_{secrets.token_hex(8)}"
        self.inventory = HostInventory(config.millicpus, config.memory_mb,
                                       parse_gpu_spec(config.gpus))
        self.runtimes: RuntimeManager | None = None
        self.jobs: JobRunner | None = None
        self.state_dir = os.path.realpath(config.state_dir)
        self.local_id = local_id(self.agent_id, self.state_dir)
        # IPC socket paths must fit in 107 bytes, so they live under a short path.
        self.sockets_dir = os.path.join(tempfile.gettempdir(), f"nbfleet-{self.local_id}")
        self.isolation = open_isolation(
            config.sandbox,
            [self.state_dir, self.sockets_dir,
             *(os.path.realpath(p) for p in config.hidden_paths)],
            os.path.join(self.state_dir, "sandbox"), self.local_id, config.limits,
            config.cgroup_parent,
        )
        self.sandbox = self.isolation.sandbox
        self._http = httpx.AsyncClient(
            base_url=config.control_url,
            headers={"Authorization": f"Bearer {config.secret}"},
            timeout=10.0,
        )
        #: Cells whose GPU bindings ended, for the control plane; kernels put, and
        #: :meth:`running` drains it.
        self.released = ReleaseQueue()
        self.reporter = ControlReporter(self._http, self.agent_id, self.boot_id)
        #: Renewed by each heartbeat answered: the file syncs write only while held.
        self.lease = Lease()
        #: Tells a workspace near its disk limit (at each heartbeat).
        self.disk_watch = DiskWatch()

    @property
    def manager(self) -> RuntimeManager:
        if self.runtimes is None:
            raise RuntimeError("agent is not registered yet")
        return self.runtimes

    @property
    def job_runner(self) -> JobRunner:
        if self.jobs is None:
            raise RuntimeError("agent is not registered yet")
        return self.jobs

    def registration(self) -> Registration:
        return Registration(
            id=self.agent_id,
            url=self.config.advertise_url,
            boot_id=self.boot_id,
            inventory={
                "sandbox": "bwrap" if self.sandbox is not None else "none",
                "isolation": self.isolation.report_json(),
                "millicpus": self.inventory.millicpus,
                "memory_mb": self.inventory.memory_mb,
                "gpus": [
                    {"count": g.count, "type": g.gpu_type, "vram_gb": g.vram_gb}
                    for g in self.inventory.gpus
                ],
                "kernelspecs": kernelspecs(),
                "gpu_holds": (self.isolation.gpus is not None
                              and self.isolation.cgroups is not None),
            },
        )

    async def register(self, attempts: int = 60) -> None:
        for attempt in range(attempts):
            try:
                response = await self._http.post(
                    "/internal/agents", json=self.registration().model_dump(mode="json"))
                response.raise_for_status()
                registered = Registered.model_validate(response.json())
                break
            except httpx.HTTPError as exc:
                if attempt == attempts - 1:
                    raise
                log.info("control plane not reachable yet (%s); retrying", exc)
                await asyncio.sleep(0.5)
        if self.runtimes is None:
            blobs = BlobStore(registered.blobs_url)
            try:  # as at the control plane's start: a clear line, not a failed suspend
                await asyncio.to_thread(blobs.check)
            except BlobStoreUnusable as exc:
                log.critical("cannot use the blob store the control plane named: %s", exc)
                raise
            files = WorkspaceFiles(blobs)
            # Whatever a previous boot left here belonged to kernels that are gone,
            # mounts included (a kill -9 unmounts nothing).
            runtimes_dir = os.path.join(self.state_dir, "runtimes")
            for leftover in (self.sockets_dir, runtimes_dir):
                remove_leftovers(leftover)
            if self.isolation.quotas is not None:
                self.isolation.quotas.sweep()
            os.makedirs(self.sockets_dir, mode=0o700)
            self.runtimes = RuntimeManager(
                self.state_dir, files, self.sockets_dir,
                isolation=self.isolation, release_delay_s=self.config.release_delay_s,
                warm_pool=self.config.warm_pool, warm_profiles=self.config.warm_profiles,
                on_released=self.released.put, on_held=self.released.hold,
                file_sync_interval_s=self.config.file_sync_interval_s, lease=self.lease,
                output_buffer_bytes=self.config.output_buffer_bytes,
            )
            if self.config.cell_checkpoints:
                self.runtimes.checkpoints = Checkpointer(
                    blobs, self.runtimes.workspace_lock, self.runtimes.runtime_generation,
                    self.reporter.checkpoint)
            self.runtimes.pool.start()
        if self.jobs is None:
            # Opening the runner kills the jobs a previous boot of this host left.
            self.jobs = JobRunner(
                self.state_dir, BlobStore(registered.blobs_url),
                self.reporter,
                heartbeat_s=self.config.job_heartbeat_s, sandbox=self.sandbox,
                identities=self.isolation.identities,
            )
            await self.jobs.open()
        log.info("registered as %s (%s)", self.agent_id, self.boot_id)

    async def heartbeat_forever(self) -> None:
        """The first at once (the lease on writing files starts with it), then one
        every ``HEARTBEAT_INTERVAL_S``."""
        while True:
            try:
                await self.heartbeat()
            except (httpx.HTTPError, ValueError) as exc:  # ValidationError is one
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def heartbeat(self) -> None:
        """Report the kernels that died and the runtimes held; once answered, fence
        off those the reply says are no longer placed here, then renew the lease
        from when this heartbeat was sent. Both happen without an await between
        them, so no file sync writes from a runtime fenced off with a fresh lease."""
        runtimes = self.runtimes
        if runtimes is not None:
            self.disk_watch.check(list(runtimes.runtimes.values()))
        deaths = runtimes.deaths[:] if runtimes is not None else []
        held = dict(runtimes.held()) if runtimes is not None else {}
        lag, behind = (runtimes.files_behind(time.monotonic()) if runtimes is not None
                       else (0.0, {}))
        quotas = self.isolation.quotas
        body = Heartbeat(boot_id=self.boot_id,
                         kernel_deaths=[KernelDeath.model_validate(d) for d in deaths],
                         runtimes=[HeldRuntime(workspace_id=ws, generation=generation,
                                               files_unsynced_s=behind.get(ws))
                                   for ws, generation in held.items()],
                         files_lag_s=lag,
                         disk_short=quotas.short()[0] if quotas is not None else None)
        sent = time.monotonic()
        response = await self._http.post(f"/internal/agents/{self.agent_id}/heartbeat",
                                         json=body.model_dump(mode="json"))
        if response.status_code in (404, 409):
            await self.register()  # the control plane lost or replaced our record
            return
        response.raise_for_status()
        if runtimes is not None:
            del runtimes.deaths[:len(deaths)]
        reply = heartbeat_reply(response)
        if runtimes is not None:
            runtimes.fence_off(reply.stale, held)
        self.lease.renew(sent, reply.agent_timeout_s)

    async def drain(self) -> None:
        """Before stopping: ask the control plane to drain this host (its workspaces
        moved with their state, or suspended) and wait until no runtime is left
        here, or ``drain_timeout_s`` passes; then shutting down loses nothing."""
        if self.config.drain_timeout_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        left: int | str = "?"
        log.warning("stopping: draining this host (up to %.0f s)", self.config.drain_timeout_s)
        while loop.time() < deadline:
            try:
                response = await self._http.post(
                    f"/internal/agents/{self.agent_id}/drain",
                    json=DrainRequest(boot_id=self.boot_id).model_dump())
                response.raise_for_status()
                left = HostDrainState.model_validate(response.json()).workspaces
            except (httpx.HTTPError, ValidationError) as exc:
                log.warning("drain request failed: %s", exc)
            here = len(self.runtimes.runtimes) if self.runtimes is not None else 0
            if left == 0 and here == 0:
                log.warning("drained: no workspace is left on this host")
                return
            await asyncio.sleep(0.5)
        log.warning("drain bound of %.0f s passed with %s workspaces left; stopping anyway",
                    self.config.drain_timeout_s, left)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        await self.register()
        beat = asyncio.create_task(self.heartbeat_forever())
        releases = asyncio.create_task(self.released.drain_forever(self.reporter.released))
        try:
            yield
        finally:
            # Whether the control plane may have placed this host's workspaces
            # elsewhere, as the agent begins to exit: if so, nothing is synced back.
            leased = self.lease.held(time.monotonic())
            for task in (beat, releases):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.jobs is not None:
                await self.jobs.close()
            if self.runtimes is not None:
                if not leased and self.runtimes.runtimes:
                    log.warning("exiting without the lease: files kernels wrote since the "
                                "last sync are not synced back")
                await self.runtimes.shutdown(sync=leased)
            with contextlib.suppress(Exception):  # best effort: the kernels just ended
                async with asyncio.timeout(2.0):
                    await self.released.send_once(self.reporter.released)
            shutil.rmtree(self.sockets_dir, ignore_errors=True)
            self.isolation.close()
            await self._http.aclose()
