"""Bringing a workspace's runtime up on this host: fresh (from the warm pool or
cold) or by promoting the standby kept here.

Both leave the runtime registered with the manager (``runtimes``), its kernels
restored and its file sync started, or nothing at all: a failure tears down what
was made.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbfleet.agent import filesync, preimports, standby_state, statesync
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.livesync import LiveSync
from nbfleet.agent.slots import WARM_IMPORTS, Slot
from nbfleet.agent.standbys import Staged, Standby, promote_files
from nbfleet.model.limits import Limits
from nbfleet.storage.snapshots import CorruptSnapshot

if TYPE_CHECKING:
    from nbfleet.agent.runtimes import RuntimeManager

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    workspace_id: str
    generation: int
    slot: Slot
    manifest: filesync.Manifest = field(default_factory=dict)
    kernels: dict[str, KernelProcess] = field(default_factory=dict)
    #: The periodic sync of what its kernels write (None: turned off).
    syncing: asyncio.Task[None] | None = None
    #: That sync's loop: how far behind the store is (``livesync``).
    file_sync: LiveSync | None = None
    #: When it was made (``time.monotonic``): without a live sync, what its kernels
    #: wrote since is in the store only at its suspend.
    started: float = field(default_factory=time.monotonic)

    @property
    def workdir(self) -> str:
        return self.slot.files


@dataclass
class Placed:
    runtime: Runtime
    #: kernel id -> what its restore brought back (empty when nothing was restored).
    restore: dict[str, dict[str, Any]] = field(default_factory=dict)
    packages: dict[str, Any] = field(default_factory=dict)


async def place(manager: RuntimeManager, workspace_id: str, generation: int,
                kernels: list[tuple[str, str]], snapshot: dict[str, str],
                packages: str | None, limits: Limits, network: str,
                devices: tuple[str, ...], notices: dict[str, str]) -> Placed:
    """The first kernel comes from the warm pool: one prepared with the modules
    its snapshot needs where there is one. What it lacks is imported while the
    snapshot downloads (``preimports``)."""
    needs = await asyncio.to_thread(preimports.snapshot_needs, manager.blobs, workspace_id,
                                    snapshot, manager.base_env)
    fits = manager._warm_fits(limits, network, devices)
    first = needs.get(kernels[0][0], preimports.NOTHING) if kernels else preimports.NOTHING
    warm = manager.pool.claim(kernels[0][1], first.profile) if kernels and fits else None
    if warm is not None and not await manager._fit(warm, limits):
        warm = None
    slot = warm.slot if warm else await asyncio.to_thread(manager.new_slot, workspace_id,
                                                            limits, network, devices)
    placed = Placed(Runtime(workspace_id, generation, slot))
    runtime = placed.runtime
    try:
        runtime.manifest, placed.packages = await asyncio.gather(
            asyncio.to_thread(filesync.materialize, manager.files, workspace_id, slot.files,
                              slot.owner),
            asyncio.to_thread(manager._restore_layer, workspace_id, packages, slot),
        )
        await asyncio.to_thread(slot.hand_over)
        layer = await asyncio.to_thread(preimports.layer_modules, slot.packages)
        for index, (kernel_id, name) in enumerate(kernels):
            loaded: frozenset[str] = frozenset()
            if index == 0 and warm is not None:
                kernel, path = warm.kernel, "warm"
                kernel.rename(kernel_id, workspace_id)
                manager._register(runtime, kernel)
                loaded = warm.modules | frozenset(WARM_IMPORTS)
                if preimports.shadowed(loaded, layer):
                    # It imported from the base environment what the workspace's
                    # own layer replaces: a fresh process loads the layer's.
                    await kernel.restart()
                    path = "cold"
            else:
                kernel, path = await manager._start_kernel(runtime, kernel_id, name), "cold"
            if notices.get(kernel_id):
                kernel.announce(notices[kernel_id])
            wanted = tuple(m for m in needs.get(kernel_id, preimports.NOTHING).modules
                           if m not in loaded and not preimports.shadowed((m,), layer))
            placed.restore[kernel_id] = await statesync.restore(
                manager.blobs, workspace_id, kernel, snapshot.get(kernel_id), path,
                prepared=warm.modules if path == "warm" and warm else frozenset(),
                preimport=wanted)
    except BaseException:
        await manager._teardown(runtime, sync=False)
        raise
    manager.runtimes[workspace_id] = runtime
    manager._start_sync(runtime)
    return placed


async def _bring_forward(manager: RuntimeManager, workspace_id: str, kernel: KernelProcess,
                         key: str | None, staged: Staged | None) -> dict[str, Any] | None:
    """Apply snapshot ``key`` to a standby kernel that holds an earlier one; its
    report, or None where a fresh kernel must restore it instead."""
    if key is None:
        return None
    try:
        return await standby_state.bring_forward(
            manager.blobs, workspace_id, kernel, key,
            staged.directory if staged is not None else None)
    except standby_state.NeedsFresh as why:
        log.warning("promoting %s: kernel %s restored afresh: %s", workspace_id, kernel.id, why)
    except (statesync.KernelFailed, CorruptSnapshot, TimeoutError, ValueError,
            OSError) as exc:
        log.warning("promoting %s: kernel %s could not apply %s, restored afresh: %r",
                    workspace_id, kernel.id, key, exc)
    return None


async def promote(manager: RuntimeManager, standby: Standby, generation: int,
                  kernels: list[tuple[str, str]], snapshot: dict[str, str],
                  packages: str | None, notices: dict[str, str]) -> Placed:
    """Serve the workspace from the standby kept here: its kernels run already,
    each with the checkpoint asked for loaded (nothing to do), or an earlier one
    (the asked one applied on top where that is exact), or nothing yet (restored
    from the staged one, or downloaded). Else a fresh kernel restores it, as on any
    placement."""
    workspace_id = standby.workspace_id
    runtime = Runtime(workspace_id, generation, standby.slot)
    placed = Placed(runtime)
    try:
        runtime.manifest = await promote_files(manager.files, workspace_id, standby.slot)
        # The caller promotes only a standby made with these packages.
        placed.packages = {"restored": packages is not None}
        for kernel_id, name in kernels:
            key = snapshot.get(kernel_id)
            staged = standby.staged.get(kernel_id)
            holds, fresh = standby.holds(kernel_id, key), standby.is_fresh(kernel_id)
            kernel = standby.kernels.pop(kernel_id, None)
            started = time.perf_counter()
            #: What the kernel holds in memory already (None: to be restored).
            held: dict[str, Any] | None = None
            if holds and staged is not None:
                held = staged.report
            elif kernel is not None and kernel.execution_state == "dead":
                await kernel.shutdown()  # it would answer nothing: a fresh kernel
                kernel = None
            elif kernel is not None and not fresh:
                # It holds another checkpoint than the one asked for: brought
                # forward where that is exact, else replaced by a fresh kernel.
                held = await _bring_forward(manager, workspace_id, kernel, key, staged)
                if held is None or held.get("recomputed"):
                    await kernel.shutdown()
                    kernel, held = None, None
            path = "standby"
            if kernel is None:  # started after the standby was last brought up to date
                kernel, path = await manager._start_kernel(runtime, kernel_id, name), "cold"
                held = None
            else:
                manager._register(runtime, kernel)
            if notices.get(kernel_id):
                kernel.announce(notices[kernel_id])
            if held is not None:
                placed.restore[kernel_id] = statesync.report_loaded(
                    kernel, path, held, holds, 0.0 if holds else time.perf_counter() - started)
                continue  # its values are in memory
            ready = staged is not None and key is not None and staged.key == key
            if ready and staged is not None:
                del standby.staged[kernel_id]  # moved into the kernel's state
            placed.restore[kernel_id] = await statesync.restore(
                manager.blobs, workspace_id, kernel, key, path,
                staged=staged.directory if ready and staged is not None else None,
                reuse=staged.directory if not ready and staged is not None else None)
    except BaseException:
        await manager._teardown(runtime, sync=False)
        raise
    finally:
        for kernel in standby.kernels.values():  # not wanted any more
            await kernel.shutdown()
        for left in list(standby.staged.values()):
            await asyncio.to_thread(shutil.rmtree, left.directory, True)
    manager.runtimes[workspace_id] = runtime
    manager._start_sync(runtime)
    return placed
