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
    settling: Settling = field(init=False)
    #: What this loop uploaded (see ``filesync.Digests``).
    digests: filesync.Digests = field(init=False, default_factory=dict)
    #: How long the last scan took.
    scan_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.settling = Settling(self.interval_s * MAX_WAIT_ROUNDS)

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
        scan = await asyncio.to_thread(filesync.scan, self.workdir())
        self.scan_s = time.monotonic() - started
        ready = self.settling.ready(scan, self.manifest(), time.monotonic())
        if not ready:
            return []
        async with self.lock:
            if not self.live():
                return []
            # Checked again against the manifest as it is now, under the lock: an
            # API write since the scan updated it, and is not uploaded again.
            manifest = self.manifest()
            for path in self.digests.keys() - manifest.keys():  # deleted by the API
                del self.digests[path]
            await asyncio.to_thread(filesync.sync_paths, self.files, self.workspace_id,
                                    self.workdir(), manifest, ready, self.digests)
        return ready
