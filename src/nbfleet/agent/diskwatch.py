"""Telling a workspace that its disk is nearly full, before a write fails.

Each workspace's files live on a filesystem of its disk limit (``sandbox.quota``);
a write past it fails with ENOSPC in the cell. A user who is warned first can
clean up before a save, a ``pip install`` or a checkpoint file fails half-way.
Checked at each heartbeat: one ``statvfs`` per running workspace.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from nbfleet.agent.placing import Runtime
from nbfleet.model.limits import format_size

log = logging.getLogger(__name__)

#: The share of its disk a workspace uses when it is told.
NEAR_FULL = 0.9


class DiskWatch:
    """Warns each workspace once each time its disk crosses ``NEAR_FULL``."""

    def __init__(self, near_full: float = NEAR_FULL) -> None:
        self.near_full = near_full
        self._warned: set[str] = set()

    def check(self, runtimes: Iterable[Runtime]) -> list[str]:
        """The workspaces warned now."""
        warned, present = [], set()
        for runtime in runtimes:
            disk = runtime.slot.disk
            if disk is None:
                continue
            workspace_id = runtime.workspace_id
            present.add(workspace_id)
            try:
                used, total = disk.usage()
            except OSError:
                continue  # being unmounted
            if used < self.near_full * total:
                self._warned.discard(workspace_id)
                continue
            if workspace_id in self._warned:
                continue
            self._warned.add(workspace_id)
            warned.append(workspace_id)
            text = (f"[nbfleet] this workspace's disk is {used / total:.0%} full "
                    f"({format_size(used)} of {format_size(total)}): a write past it will "
                    "fail with 'No space left on device'. Delete files you no longer "
                    "need, or ask an admin for a larger workspace disk.\n")
            log.info("workspace %s is near its disk limit (%s of %s)", workspace_id,
                     format_size(used), format_size(total))
            for kernel in runtime.kernels.values():
                kernel.warn_in_cell(text)
        self._warned &= present
        return warned
