"""Everything a control-plane process shares: config, DB, blob store, agent client."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from nbfleet.control.agent_client import AgentClient
from nbfleet.control.fleet.service import FleetService
from nbfleet.control.fleet.sizing import FleetSettings
from nbfleet.control.standbys import StandbyKeeper
from nbfleet.db.engine import Database
from nbfleet.jobs.settings import JobSettings
from nbfleet.model.jobs import RetryRules, parse_tiers
from nbfleet.model.pricing import parse_prices
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles
from nbfleet.web.browser import SECURE_COOKIES_DEFAULT

T = TypeVar("T")


@dataclass
class ControlConfig:
    db_url: str
    blobs_url: str
    secret: str
    reconcile_interval_s: float = 1.0
    lease_ttl_s: float = 5.0
    agent_timeout_s: float = 10.0
    #: Suspend a workspace whose kernels have been idle this long (0: never). A
    #: project's own setting wins.
    idle_suspend_s: float = 3600.0
    cull_interval_s: float = 30.0
    #: A suspend that finds a cell running: "wait" (then interrupt) or "interrupt".
    suspend_on_busy: str = "wait"
    suspend_busy_timeout_s: float = 30.0
    #: Seconds between passes of the credit reaper (lapsed holds, expired grants).
    credit_reap_interval_s: float = 5.0
    #: Requests under /v1 per token (all items apply; "0" or "none": no limit), and
    #: where they are counted: "memory://" per replica, "redis://…" across replicas.
    rate_limit: str = "100/second;3000/minute"
    rate_limit_storage: str = "memory://"
    #: Browser cookies' ``Secure`` flag: "auto" (when the request came over https,
    #: as uvicorn reads it) or "always" (behind a TLS proxy; ``web.browser``).
    secure_cookies: str = SECURE_COOKIES_DEFAULT
    #: GPU jobs: priority tiers, prices (credits per GPU-hour by type), and the
    #: rest of ``JobSettings``.
    job_tiers: str = "free=0,paid=10"
    gpu_prices: str = "default=1"
    job_heartbeat_timeout_s: float = 15.0
    job_kill_grace_s: float = 10.0
    job_result_retention_s: float = 7 * 86400.0
    job_backoff_base_s: float = 2.0
    #: Seconds between dispatch passes when nothing wakes the dispatcher sooner.
    job_dispatch_interval_s: float = 1.0
    #: The GPU scheduling policy and the fleet it may grow to (``--policy``,
    #: ``--host-gpus``, ``--max-hosts``, ``--replicas``, the autoscaler's timing).
    fleet: FleetSettings = field(default_factory=FleetSettings)
    #: Seconds between usage reports of running GPU cells and standby replicas.
    meter_interval_s: float = 15.0
    #: This control plane's own URL and home (where hosts it starts keep their
    #: state, and what their kernels never see).
    control_url: str = ""
    home_dir: str = ""
    #: Extra options for the agents the local host provider starts.
    host_agent_args: str = ""

    def job_settings(self) -> JobSettings:
        """Raises ``InvalidInput`` for a bad tier or price list."""
        return JobSettings(
            tiers=parse_tiers(self.job_tiers), prices=parse_prices(self.gpu_prices),
            retry=RetryRules(backoff_base_s=self.job_backoff_base_s,
                             backoff_cap_s=max(300.0, self.job_backoff_base_s)),
            heartbeat_timeout_s=self.job_heartbeat_timeout_s,
            result_retention_s=self.job_result_retention_s, kill_grace_s=self.job_kill_grace_s)


@dataclass
class Platform:
    config: ControlConfig
    db: Database = field(init=False)
    blobs: BlobStore = field(init=False)
    files: WorkspaceFiles = field(init=False)
    agents: AgentClient = field(init=False)
    jobs: JobSettings = field(init=False)
    #: The GPU scheduler (active on the replica holding the reconciler's lease).
    fleet: FleetService = field(init=False)
    #: Set to run a dispatch pass now (the job dispatcher waits on it).
    jobs_wake: asyncio.Event | None = None
    instance_id: str = field(default_factory=lambda: f"ctl_{secrets.token_hex(6)}")
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _changed: asyncio.Event | None = None
    #: Per workspace: only its own waiters wake at its changes (held by the waiters).
    _changed_for: weakref.WeakValueDictionary[str, asyncio.Event] = field(
        default_factory=weakref.WeakValueDictionary, repr=False)

    def __post_init__(self) -> None:
        self.db = Database(self.config.db_url)
        self.blobs = BlobStore(self.config.blobs_url)
        self.files = WorkspaceFiles(self.blobs)
        self.agents = AgentClient(self.config.secret)
        self.jobs = self.config.job_settings()
        self.fleet = FleetService(self)
        self.standbys = StandbyKeeper(self)

    def bind_loop(self) -> asyncio.Event:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        return self._wake

    def changed(self, workspace_id: str | None = None) -> asyncio.Event:
        """An event set at the next workspace change this process makes (to
        ``workspace_id`` only, when given: in a burst of 32 resumes, each change then
        wakes its own waiter rather than all 32, which each read the DB again).

        Take it *before* reading the state you wait on, so no change slips between.
        Changes made by other replicas are not signalled: waiters also poll.
        """
        if workspace_id is not None:
            event = self._changed_for.get(workspace_id)
            if event is None:
                event = self._changed_for[workspace_id] = asyncio.Event()
            return event
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def poll_s(self) -> float:
        """How long a waiter of :meth:`changed` waits before it reads again anyway.
        A replica that runs the reconciler (holds its lease) makes the changes and
        signals them: it reads again only as a safety net (a waiter's read costs the
        DB and the event loop, 32 of them in a burst of resumes). Elsewhere, the
        changes are another replica's, seen only by reading: often."""
        return 1.0 if self.fleet.token is not None else 0.25

    async def until(self, workspace_id: str, read: Callable[[], tuple[bool, T]],
                    timeout: float) -> tuple[bool, T]:
        """Run ``read`` (in a thread: it reads the DB) at each change of the
        workspace until it answers done or ``timeout`` passes; its last answer. The
        one wait behind ``?wait=`` and a resting kernel's wake-up."""
        deadline = time.monotonic() + timeout
        while True:
            changed = self.changed(workspace_id)  # before the read: no change slips by
            done, value = await asyncio.to_thread(read)
            remaining = deadline - time.monotonic()
            if done or remaining <= 0:
                return done, value
            with contextlib.suppress(TimeoutError):  # other replicas do not signal: poll
                async with asyncio.timeout(min(remaining, self.poll_s())):
                    await changed.wait()

    def notify_changed(self, workspace_id: str | None = None) -> None:
        """Wake the waiters of :meth:`changed`: all of them, and those of
        ``workspace_id`` (of every workspace when None) (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fire_changed, workspace_id)

    def _fire_changed(self, workspace_id: str | None = None) -> None:
        fired, self._changed = self._changed, None
        if workspace_id is None:
            events = [fired, *self._changed_for.values()]
            self._changed_for.clear()
        else:
            events = [fired, self._changed_for.pop(workspace_id, None)]
        for event in events:
            if event is not None:
                event.set()

    def wake(self) -> None:
        """Nudge the reconciler now instead of at its next tick (thread-safe)."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def bind_jobs_loop(self) -> asyncio.Event:
        self._loop = self._loop or asyncio.get_running_loop()
        self.jobs_wake = asyncio.Event()
        return self.jobs_wake

    def wake_jobs(self) -> None:
        """Nudge this replica's job dispatcher (thread-safe); other replicas hear
        of the change through PostgreSQL's NOTIFY."""
        if self._loop is not None and self.jobs_wake is not None:
            self._loop.call_soon_threadsafe(self.jobs_wake.set)

    async def aclose(self) -> None:
        await self.agents.aclose()
        self.db.dispose()
