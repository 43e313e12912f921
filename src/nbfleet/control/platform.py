"""Everything a control-plane process shares: config, DB, blob store, agent client."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from nbfleet.control.agent_client import AgentClient
from nbfleet.db.engine import Database
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles


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


@dataclass
class Platform:
    config: ControlConfig
    db: Database = field(init=False)
    blobs: BlobStore = field(init=False)
    files: WorkspaceFiles = field(init=False)
    agents: AgentClient = field(init=False)
    instance_id: str = field(default_factory=lambda: f"ctl_{secrets.token_hex(6)}")
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _changed: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self.db = Database(self.config.db_url)
        self.blobs = BlobStore(self.config.blobs_url)
        self.files = WorkspaceFiles(self.blobs)
        self.agents = AgentClient(self.config.secret)

    def bind_loop(self) -> asyncio.Event:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        return self._wake

    def changed(self) -> asyncio.Event:
        """An event set at the next workspace change this process makes.

        Take it *before* reading the state you wait on, so no change slips between.
        Changes made by other replicas are not signalled: waiters also poll.
        """
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def notify_changed(self) -> None:
        """Wake the waiters of :meth:`changed` (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fire_changed)

    def _fire_changed(self) -> None:
        fired, self._changed = self._changed, None
        if fired is not None:
            fired.set()

    def wake(self) -> None:
        """Nudge the reconciler now instead of at its next tick (thread-safe)."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def aclose(self) -> None:
        await self.agents.aclose()
        self.db.dispose()
