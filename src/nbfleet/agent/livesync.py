"""Periodic sync of what a live runtime's kernels write back to the blob store.

Files that kernel code writes would otherwise reach the store (their source of
truth) only at suspend or release, and a host lost before then loses them. Every
``interval_s`` each runtime's working directory is stat-scanned (no reads) and
compared with its manifest; only the paths that changed are read and uploaded, or
deleted from the store. The recovery point objective for kernel-written files is
therefore about two intervals (a file must stop changing for one round first),
and at most ``max_wait_s`` for a file that never stops changing.

Debounced: a path is synced once its stamp was the same at two scans in a row, so
a file still being written is not uploaded half-done round after round. Rounds
never overlap (the next sleep starts when a round ends), and a tree whose scan is
slow is scanned less often, so scanning stays a small share of a core.

Cost per round: one ``stat`` per file of the runtime, plus reads and uploads of
the changed files only. Unchanged data is not sent again: a file whose stamp
changed but whose bytes are those the loop last uploaded for it (rewritten with
the same content, touched) is read and hashed, not uploaded. Only bytes this loop
uploaded are known: a file as materialized from the store is uploaded once the
first time its stamp changes.

Fenced by a lease (:class:`Lease`): a round writes only while the agent's last
heartbeat that the control plane answered was sent recently enough that the
control plane cannot have presumed this host dead since and placed its workspaces
elsewhere. An agent that stalled (SIGSTOP, a frozen VM) past the agent timeout
skips its rounds when it wakes, until a heartbeat has told it which of its
runtimes are no longer its own (``RuntimeManager.fence_off``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nbfleet.agent import filesync
from nbfleet.storage.files import WorkspaceFiles

log = logging.getLogger(__name__)

#: A scan may take at most this share of the time between rounds.
SCAN_SHARE = 0.1
#: A file that keeps changing is synced anyway after this many intervals.
MAX_WAIT_ROUNDS = 5
#: The control plane's agent timeout where it does not say (an older control
#: plane's heartbeat reply has no body): its default.
DEFAULT_AGENT_TIMEOUT_S = 10.0
#: The share of the agent timeout a heartbeat's lease lasts. The rest is left for a
#: round that found the lease held to finish its uploads before the control plane
#: may presume the host dead (a round longer than that is not fenced).
LEASE_SHARE = 0.5


@dataclass
class Lease:
    """The agent's right to write to the store on its own (pure: the caller passes
    the clock, ``time.monotonic()``). Measured from when the last heartbeat that
    was answered was *sent*: the control plane recorded it no earlier, so it cannot
    presume this host dead before ``timeout_s`` after that."""

    timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    #: When the last answered heartbeat was sent (None: none yet).
    sent_at: float | None = None

    def renew(self, sent_at: float, timeout_s: float) -> None:
        """A heartbeat sent at ``sent_at`` was answered (a late answer to an older
        one never moves the lease back)."""
        self.timeout_s = timeout_s
        if self.sent_at is None or sent_at > self.sent_at:
            self.sent_at = sent_at

    def age(self, now: float) -> float | None:
        return None if self.sent_at is None else now - self.sent_at

    def held(self, now: float) -> bool:
        age = self.age(now)
        return age is not None and age < self.timeout_s * LEASE_SHARE


@dataclass
class Settling:
    """Which changed paths have settled (pure: the caller passes the clock)."""

    max_wait_s: float
    #: The previous scan (None before the first).
    previous: filesync.Manifest | None = None
    #: path -> when it was first seen differing from the manifest.
    since: dict[str, float] = field(default_factory=dict)

    def ready(self, scan: filesync.Manifest, manifest: filesync.Manifest,
              now: float) -> list[str]:
        """The paths to sync now: those that differ from ``manifest`` (changed,
        created or removed) and either look the same as at the previous scan or
        have differed for ``max_wait_s``."""
        differing = {path for path, stamp in scan.items() if manifest.get(path) != stamp}
        differing.update(path for path in manifest if path not in scan)
        previous, self.previous = self.previous, scan
        for path in [p for p in self.since if p not in differing]:
            del self.since[path]
        ready = []
        for path in sorted(differing):
            first = self.since.setdefault(path, now)
            settled = previous is not None and previous.get(path) == scan.get(path)
            if settled or now - first >= self.max_wait_s:
                ready.append(path)
        return ready


@dataclass
class LiveSync:
    """One runtime's sync loop. ``workdir`` and ``manifest`` are read each round
    (a runtime may move to a claimed warm slot, and suspends replace its
    manifest); ``live`` says whether the runtime still exists. The caller holds
    ``lock`` (the workspace's, which API writes take too) around everything that
    touches the manifest, so a sync and an API write never interleave."""

    files: WorkspaceFiles
    workspace_id: str
    workdir: Callable[[], str]
    manifest: Callable[[], filesync.Manifest]
    live: Callable[[], bool]
    lock: asyncio.Lock
    interval_s: float
    #: Writes only while held (None: no control plane can presume this host dead).
    lease: Lease | None = None
    clock: Callable[[], float] = time.monotonic
    settling: Settling = field(init=False)
    #: What this loop uploaded (see ``filesync.Digests``).
    digests: filesync.Digests = field(init=False, default_factory=dict)
    #: How long the last scan took.
    scan_s: float = field(init=False, default=0.0)
    #: A round was skipped for a stale lease since the last one that was not (it
    #: was logged; the next skips are not).
    skipping: bool = field(init=False, default=False)
    #: When (``clock``) the store last held every file as a scan found it: the
    #: runtime started from the store, then each round that left nothing unsynced.
    #: What a lost host loses is what its kernels wrote since.
    synced_at: float = field(init=False)
    #: Whether the last round left nothing unsynced.
    clean: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        self.settling = Settling(self.interval_s * MAX_WAIT_ROUNDS)
        self.synced_at = self.clock()

    def _scanned(self, at: float, clean: bool) -> None:
        self.clean = clean
        if clean:
            self.synced_at = at

    async def run(self) -> None:
        """Until cancelled (the runtime's teardown does, holding ``lock``, so a
        round is never cut off while it writes the store)."""
        while True:
            # A tree whose scan is slow is scanned less often (uploads do not count:
            # they are the work itself, and only what changed).
            await asyncio.sleep(max(self.interval_s, self.scan_s / SCAN_SHARE))
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store down, say: the next round tries again
                log.warning("file sync of %s failed (tried again next round): %r",
                            self.workspace_id, exc)

    async def round(self) -> list[str]:
        """Scan, then sync what settled; returns the paths synced."""
        started = time.monotonic()
        scanned_at = self.clock()
        scan = await asyncio.to_thread(filesync.scan, self.workdir())
        self.scan_s = time.monotonic() - started
        ready = self.settling.ready(scan, self.manifest(), time.monotonic())
        if not ready:
            self._scanned(scanned_at, not self.settling.since)  # clean: nothing differs
            return []
        async with self.lock:
            if not self.live() or not self._lease_held():
                self.clean = False
                return []
            # Checked again against the manifest as it is now, under the lock: an
            # API write since the scan updated it, and is not uploaded again.
            manifest = self.manifest()
            for path in self.digests.keys() - manifest.keys():  # deleted by the API
                del self.digests[path]
            self.clean = False  # until the sync is done
            await asyncio.to_thread(filesync.sync_paths, self.files, self.workspace_id,
                                    self.workdir(), manifest, ready, self.digests)
        # Clean when all that differed at the scan is stored now.
        self._scanned(scanned_at, set(self.settling.since) <= set(ready))
        return ready

    def _lease_held(self) -> bool:
        """Checked under the lock, just before writing; a stale lease is logged once
        per lapse, and the paths ready now are synced at a round that holds it."""
        if self.lease is None or self.lease.held(self.clock()):
            self.skipping = False
            return True
        if not self.skipping:
            self.skipping = True
            age = self.lease.age(self.clock())
            log.warning("file sync of %s paused: %s, so the control plane may have placed "
                        "it elsewhere (tried again next round)", self.workspace_id,
                        "no heartbeat answered yet" if age is None
                        else f"the last heartbeat answered was sent {age:.1f} s ago")
        return False
