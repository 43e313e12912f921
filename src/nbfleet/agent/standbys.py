"""Standby replicas: a workspace's kernels kept warm on a host it does not run on.

Under a replica policy the scheduler gives a GPU workspace's kernel several
hosts; it runs on one. On each of the others the control plane keeps a standby
(``control/standbys.py``): a sandbox slot with the workspace's files and package
layer, its kernels started with the modules their state needs already imported,
and the state of the executor's last checkpointed cell loaded in them. After each
cell the control plane sends the new checkpoint, off the critical path: only the
blobs this host lacks are fetched, and only the groups of values that changed
are loaded (``standby_state``; a checkpoint that cannot be applied exactly is
loaded into a new kernel instead).

A placement of the workspace on this host (a lost executor, a move for a cell's
GPUs) promotes the standby (``agent/placing.promote``): its files are brought up
to date from the store, and kernels that hold the checkpoint asked for serve at
once, with nothing to load.

No client can reach a standby's kernels: they are not in the host's kernel table,
and no client request reaches them. They do run code of the workspace's own as
they start (its package layer's, e.g. a ``sitecustomize``), in the workspace's
sandbox, with its limits, on the replica host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbfleet.agent import filesync, preimports, standby_state, statesync
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.sandbox import Sandbox
from nbfleet.agent.slots import Slot, new_kernel
from nbfleet.model.errors import Conflict, NotFound
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles
from nbfleet.storage.snapshots import CorruptSnapshot, download_state

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """A snapshot downloaded and verified in an agent-only directory."""

    key: str
    cell: int | None
    directory: str
    #: What loading it into the standby's kernel reported; None until it loaded.
    report: dict[str, Any] | None = None


@dataclass
class Standby:
    workspace_id: str
    generation: int
    slot: Slot
    kernels: dict[str, KernelProcess] = field(default_factory=dict)
    #: The package layer restored into the slot.
    packages: str | None = None
    #: What its slot was made with (limits, network, devices): a promotion needs
    #: the same, or the workspace is placed afresh.
    slot_args: tuple[object, ...] = ()
    staged: dict[str, Staged] = field(default_factory=dict)
    #: Kernels something was loaded into, with their restart count then: one that
    #: restarted since (it died) is empty again.
    loaded: dict[str, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def is_fresh(self, kernel_id: str) -> bool:
        """Nothing was loaded into the kernel's namespace (or it restarted since)."""
        kernel = self.kernels.get(kernel_id)
        return kernel is None or self.loaded.get(kernel_id) != kernel.restarts

    def holds(self, kernel_id: str, key: str | None) -> bool:
        """The kernel holds checkpoint ``key`` in memory, exactly as a restore of it
        would: loaded, alive, not restarted since, and with no value recomputed
        from its cells (those ran against the files the standby had then)."""
        staged = self.staged.get(kernel_id)
        kernel = self.kernels.get(kernel_id)
        return (key is not None and staged is not None and staged.key == key
                and staged.report is not None and not staged.report.get("recomputed")
                and kernel is not None and kernel.execution_state != "dead"
                and not self.is_fresh(kernel_id))

    def state(self) -> dict[str, dict[str, str | int | None]]:
        """Every kernel kept, with the checkpoint loaded in it (key None: none yet)."""
        return {kid: ({"key": self.staged[kid].key, "cell": self.staged[kid].cell}
                      if kid in self.staged and self.holds(kid, self.staged[kid].key)
                      else {"key": None, "cell": None})
                for kid in self.kernels}


class Standbys:
    """This host's standbys, by workspace. ``new_slot`` and ``restore_layer`` are the
    runtime manager's, so a standby's sandbox is exactly a runtime's."""

    def __init__(self, files: WorkspaceFiles, blobs: BlobStore,
                 new_slot: Callable[..., Slot], sandbox: Sandbox | None,
                 restore_layer: Callable[[str, str | None, Slot], object],
                 base_env: preimports.BaseEnvironment) -> None:
        self.files = files
        self.blobs = blobs
        self.new_slot = new_slot
        self.sandbox = sandbox
        self.restore_layer = restore_layer
        self.base_env = base_env
        self.by_workspace: dict[str, Standby] = {}

    async def keep(self, workspace_id: str, generation: int,
                   kernels: list[tuple[str, str]], snapshot: dict[str, str],
                   packages: str | None, slot_args: tuple[object, ...],
                   is_running_here: bool) -> Standby:
        """Make the standby exist (idempotent: an existing one is kept as it is)."""
        if is_running_here:
            raise Conflict(f"workspace {workspace_id} runs on this host: no standby here")
        standby = self.by_workspace.get(workspace_id)
        if standby is not None:
            # Kept already: it follows the workspace's kernels (one started or shut
            # down since), the rest as it is.
            standby.generation = max(standby.generation, generation)
            async with standby.lock:
                await self._follow_kernels(standby, kernels, snapshot)
            return standby
        # A name of its own: a runtime of the workspace may be made here while the
        # standby is being dropped, and must not share its root, cgroup or sockets.
        slot = await asyncio.to_thread(self.new_slot, f"{workspace_id}-standby", *slot_args)
        standby = Standby(workspace_id, generation, slot, packages=packages,
                          slot_args=slot_args)
        try:
            await asyncio.to_thread(filesync.materialize, self.files, workspace_id, slot.files,
                                    slot.owner)
            await asyncio.to_thread(self.restore_layer, workspace_id, packages, slot)
            await asyncio.to_thread(slot.hand_over)
            await self._follow_kernels(standby, kernels, snapshot)
        except BaseException:
            await self._remove(standby)
            raise
        self.by_workspace[workspace_id] = standby
        return standby

    async def _follow_kernels(self, standby: Standby, kernels: list[tuple[str, str]],
                              snapshot: dict[str, str]) -> None:
        """Start the kernels the standby lacks (staging their state), stop the ones
        the workspace no longer has."""
        wanted = dict(kernels)
        for kernel_id in [k for k in standby.kernels if k not in wanted]:
            await standby.kernels.pop(kernel_id).shutdown()
            standby.loaded.pop(kernel_id, None)
            gone = standby.staged.pop(kernel_id, None)
            if gone is not None:
                await asyncio.to_thread(shutil.rmtree, gone.directory, True)
        missing = [(k, name) for k, name in kernels if k not in standby.kernels]
        for kernel_id, name in missing:
            standby.names[kernel_id] = name
            await self._start_kernel(standby, kernel_id, snapshot.get(kernel_id))
            if snapshot.get(kernel_id):
                try:
                    await self._stage(standby, kernel_id, snapshot[kernel_id], None)
                except (CorruptSnapshot, OSError, Conflict) as exc:
                    # Replaced since it was named (the next checkpoint is staged), or
                    # unusable: the standby is kept warm without it.
                    log.info("standby of %s: %s not staged: %s", standby.workspace_id,
                             kernel_id, exc)

    async def _start_kernel(self, standby: Standby, kernel_id: str,
                            key: str | None) -> KernelProcess:
        """A fresh kernel, with the modules the checkpoint ``key`` needs imported."""
        kernel = new_kernel(standby.slot, kernel_id, standby.workspace_id,
                            standby.names[kernel_id], self.sandbox)
        try:
            await kernel.start()
        except BaseException:
            await kernel.shutdown()
            raise
        standby.kernels[kernel_id] = kernel
        standby.loaded.pop(kernel_id, None)
        if key:
            needs = await asyncio.to_thread(preimports.snapshot_needs, self.blobs,
                                            standby.workspace_id, {kernel_id: key},
                                            self.base_env)
            modules = needs.get(kernel_id, preimports.NOTHING).modules
            if modules:
                await statesync.preimport(kernel, modules)
        return kernel

    async def stage(self, workspace_id: str, generation: int, kernel_id: str, key: str,
                    cell: int | None) -> Standby:
        """Download a newer checkpoint of one kernel (only the blobs not staged yet)."""
        standby = self.by_workspace.get(workspace_id)
        if standby is None or kernel_id not in standby.kernels:
            raise NotFound(f"no standby of {workspace_id}/{kernel_id} on this host")
        if generation < standby.generation:
            raise Conflict(f"stale checkpoint for {workspace_id}: generation {generation} < "
                           f"{standby.generation}", current_generation=standby.generation)
        async with standby.lock:
            if self.by_workspace.get(workspace_id) is standby:
                try:
                    await self._stage(standby, kernel_id, key, cell)
                except CorruptSnapshot as exc:
                    raise Conflict(f"checkpoint {key} not staged: {exc}") from exc
        return standby

    async def _stage(self, standby: Standby, kernel_id: str, key: str,
                     cell: int | None) -> None:
        old = standby.staged.get(kernel_id)
        if old is not None and old.key == key:
            old.cell = cell if cell is not None else old.cell  # the same state, a later cell
            if old.report is None:
                await self._load(standby, kernel_id, old)
            return
        directory = os.path.join(standby.slot.stage,
                                 f".standby-{kernel_id[:12]}-{secrets.token_hex(4)}")
        os.mkdir(directory, 0o700)
        try:
            await asyncio.to_thread(download_state, self.blobs, standby.workspace_id, key,
                                    directory, old.directory if old else None)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        staged = standby.staged[kernel_id] = Staged(key, cell, directory)
        if old is not None:
            await asyncio.to_thread(shutil.rmtree, old.directory, True)
        await self._load(standby, kernel_id, staged)

    async def _load(self, standby: Standby, kernel_id: str, staged: Staged) -> None:
        """Load ``staged`` into the kernel: applied on top of what it holds, or into
        a new kernel where that would not be exact. Conflict if it did not load
        (the control plane's keeper then backs off before it sends it again)."""
        kernel = standby.kernels[kernel_id]
        try:
            try:
                first = standby.is_fresh(kernel_id)
                standby.loaded[kernel_id] = kernel.restarts
                staged.report = await standby_state.load(kernel, staged.directory, first)
            except standby_state.NeedsFresh as why:
                log.info("standby of %s: %s loaded into a new kernel: %s",
                         standby.workspace_id, kernel_id, why)
                # Out of the standby first: should the new one fail to start, none is
                # kept (the next keep starts one) rather than this one, shut down.
                del standby.kernels[kernel_id]
                standby.loaded.pop(kernel_id, None)
                await kernel.shutdown()
                kernel = await self._start_kernel(standby, kernel_id, staged.key)
                standby.loaded[kernel_id] = kernel.restarts
                staged.report = await standby_state.load(kernel, staged.directory, True)
        except Exception as exc:  # a kernel that failed, timed out or would not start
            staged.report = None
            raise Conflict(f"checkpoint {staged.key} not loaded on the standby: {exc}"
                           ) from exc

    def take(self, workspace_id: str) -> Standby | None:
        """The standby, handed over for a promotion (it is no longer a standby: a
        stage still running finishes first, under ``standby.lock``, which the
        promotion takes; later ones find none). The caller holds the workspace's
        lock, as for :meth:`drop` and :meth:`keep`."""
        return self.by_workspace.pop(workspace_id, None)

    async def drop(self, workspace_id: str) -> bool:
        standby = self.by_workspace.pop(workspace_id, None)
        if standby is None:
            return False
        await self.discard(standby)
        return True

    async def discard(self, standby: Standby) -> None:
        async with standby.lock:
            await self._remove(standby)

    async def shutdown(self) -> None:
        for workspace_id in list(self.by_workspace):
            with contextlib.suppress(Exception):
                await self.drop(workspace_id)

    @staticmethod
    async def _remove(standby: Standby) -> None:
        await asyncio.gather(*(k.shutdown() for k in standby.kernels.values()),
                             return_exceptions=True)
        standby.kernels.clear()
        await asyncio.to_thread(standby.slot.remove)


async def promote_files(files: WorkspaceFiles, workspace_id: str, slot: Slot) -> dict[
        str, tuple[int, int]]:
    """The store's files, as of now, in a standby's working directory (the executor
    wrote some since the standby was made): emptied, then materialized again."""
    def refresh() -> dict[str, tuple[int, int]]:
        with os.scandir(slot.files) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        return filesync.materialize(files, workspace_id, slot.files, slot.owner)
    return await asyncio.to_thread(refresh)

