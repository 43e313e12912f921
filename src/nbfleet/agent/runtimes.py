"""Workspace runtimes on this host: a slot (see ``slots``) plus the workspace's kernels.

Every command carries the workspace generation. The agent remembers the highest
generation it has seen per workspace and refuses older commands, so a delayed
"place" can never resurrect a runtime that a newer "release" removed. One lock per
workspace serializes commands, so a resume asked for twice gives one runtime.

A runtime the control plane no longer places here (this host was presumed dead
and the workspace runs elsewhere) is fenced off as soon as a heartbeat says so:
it writes nothing to the store from then on, and is torn down without syncing
its files back (:meth:`RuntimeManager.fence_off`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nbfleet.agent import filesync, placing, preimports, statesync
from nbfleet.agent.checkpoints import Checkpointer
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.livesync import Lease, LiveSync
from nbfleet.agent.output import DEFAULT_OUTPUT_BUFFER_BYTES
from nbfleet.agent.placing import Placed, Runtime
from nbfleet.agent.sandbox import Isolation, gpu_devices
from nbfleet.agent.slots import Slot, new_kernel
from nbfleet.agent.standbys import Standby, Standbys
from nbfleet.agent.warmpool import Warm, WarmPool
from nbfleet.model.errors import Conflict, NotFound, SuspendFailed
from nbfleet.model.limits import Limits
from nbfleet.storage.files import WorkspaceFiles
from nbfleet.storage.snapshots import CorruptSnapshot, restore_layer, store_layer

log = logging.getLogger(__name__)


class RuntimeManager:
    def __init__(self, state_dir: str, files: WorkspaceFiles, sockets_dir: str,
                 isolation: Isolation | None = None, release_delay_s: float = 0.0,
                 warm_pool: int = 0, warm_profiles: int | None = None,
                 on_released: Callable[[list[str]], None] | None = None,
                 on_held: Callable[[list[str]], None] | None = None,
                 file_sync_interval_s: float = 0.0, lease: Lease | None = None,
                 output_buffer_bytes: int = DEFAULT_OUTPUT_BUFFER_BYTES) -> None:
        self.runtimes_dir = f"{state_dir}/runtimes"
        self.sockets_dir = sockets_dir
        self.isolation = isolation or Isolation(None)
        self.sandbox = self.isolation.sandbox
        self.output_buffer_bytes = output_buffer_bytes
        #: Kernel deaths with a known reason (a memory limit), for the next heartbeat:
        #: the control plane records them as the workspace's last error.
        self.deaths: list[dict[str, str]] = []
        self.files = files
        self.blobs = files.blobs
        self.runtimes: dict[str, Runtime] = {}
        self.kernels: dict[str, KernelProcess] = {}
        self._generations: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: This host's GPU device nodes (none where its GPUs are only declared).
        self.gpu_devices = tuple(gpu_devices())
        self.pool = WarmPool(warm_pool, self._warm_slot, self.sandbox, profiles=warm_profiles)
        #: Where kernels import the platform's packages from (``preimports``).
        self.base_env = preimports.BaseEnvironment.of_kernels()
        #: Fault injection for crash tests: hold a release or suspend open this long
        #: (a suspend, after its uploads and before it answers).
        self.release_delay_s = release_delay_s
        #: Told the task ids of cells whose GPU bindings ended (reply, death, restart,
        #: suspend, release); must not block (see ``bindings.ReleaseQueue.put``).
        self.on_released: Callable[[list[str]], None] = on_released or (lambda task_ids: None)
        #: Told the cells that ended with a GPU still open in their slot.
        self.on_held: Callable[[list[str]], None] = on_held or (lambda task_ids: None)
        #: Seconds between syncs of what a live runtime's kernels write (0: only at
        #: suspend and release). See ``livesync``.
        self.file_sync_interval_s = file_sync_interval_s
        #: The agent's lease on writing files to the store on its own (None: no
        #: control plane can presume this host dead, as in tests).
        self.lease = lease
        #: workspace id -> its runtime fenced off (being dropped: ``fence_off``).
        self._fenced: dict[str, Runtime] = {}
        self._drops: set[asyncio.Task[None]] = set()
        #: Saves each kernel's state after every cell (None: only at suspend).
        self.checkpoints: Checkpointer | None = None
        #: Other hosts' workspaces kept warm here (``standbys``).
        self.standbys = Standbys(files, self.blobs, self.new_slot, self.sandbox,
                                 self._restore_layer, self.base_env)

    def new_slot(self, name: str, limits: Limits | None = None, network: str = "none",
                 devices: tuple[str, ...] = ()) -> Slot:
        slot = Slot.create(self.runtimes_dir, self.sockets_dir, name, self.isolation, limits,
                           network, devices)
        slot.output_buffer_bytes = self.output_buffer_bytes
        return slot

    def _warm_slot(self, name: str) -> Slot:
        """Warm slots on a host with GPUs see them: the policy prewarms a host for the
        GPU kernels it will move there (and a workspace without GPUs never claims one)."""
        return self.new_slot(name, devices=self.gpu_devices)

    def _lock(self, workspace_id: str) -> asyncio.Lock:
        return self._locks.setdefault(workspace_id, asyncio.Lock())

    def workspace_lock(self, workspace_id: str) -> asyncio.Lock:
        """Held by every command on the workspace, its file syncs and checkpoints."""
        return self._lock(workspace_id)

    def _fence(self, workspace_id: str, generation: int) -> None:
        seen = self._generations.get(workspace_id, 0)
        if generation < seen:
            raise Conflict(
                f"stale command for {workspace_id}: generation {generation} < {seen}",
                current_generation=seen,
            )
        self._generations[workspace_id] = generation

    # ------------------------------------------------------------------ placing
    async def ensure(self, workspace_id: str, generation: int,
                     kernels: Iterable[tuple[str, str]],
                     snapshot: dict[str, str] | None = None,
                     packages: str | None = None, limits: Limits | None = None,
                     network: str = "none", gpus: int = 0,
                     notices: dict[str, str] | None = None) -> Placed:
        """Make the runtime exist with these kernels running (idempotent).

        A new runtime gets the workspace's files, its package layer and each
        kernel's last snapshot; its first kernel comes from the warm pool if one is
        ready there. ``notices``: kernel id -> what its notebook is told first (why it
        restarts here).
        """
        wanted = list(kernels)
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            runtime = self.runtimes.get(workspace_id)
            if runtime is not None and (runtime.generation < generation
                                        or self._fenced.get(workspace_id) is runtime):
                # A placement is asked for only when the last one ended (released,
                # moved, or lost with its host): a runtime still here from an older
                # one (or fenced off) is a placement the control plane gave up on
                # (this host was presumed dead), with state older than the store's.
                log.warning("replacing a stale runtime of %s (generation %d, asked %d)",
                            workspace_id, runtime.generation, generation)
                await self._teardown(runtime, sync=False)
                runtime = None
            if runtime is None:
                devices = self.gpu_devices if gpus else ()
                slot_args = (self.isolation.limits.over(limits), network, devices)
                standby = self.standbys.take(workspace_id)
                if standby is not None:
                    async with standby.lock:  # a stage still running ends first
                        if standby.slot_args == slot_args and standby.packages == packages:
                            return await placing.promote(self, standby, generation, wanted,
                                                         snapshot or {}, packages,
                                                         notices or {})
                    # Made with other limits, network or packages: a layer is never
                    # unpacked where the workspace's code has run already.
                    await self.standbys.discard(standby)
                return await placing.place(self, workspace_id, generation, wanted,
                                           snapshot or {}, packages, *slot_args,
                                           notices or {})
            runtime.generation = generation
            for kernel_id, name in wanted:
                if kernel_id not in runtime.kernels:
                    await self._start_kernel(runtime, kernel_id, name)
            return Placed(runtime)

    async def drop_standby(self, workspace_id: str) -> bool:
        async with self._lock(workspace_id):
            return await self.standbys.drop(workspace_id)

    async def keep_standby(self, workspace_id: str, generation: int,
                           kernels: Iterable[tuple[str, str]], snapshot: dict[str, str],
                           packages: str | None, limits: Limits | None = None,
                           network: str = "none", gpus: int = 0) -> Standby:
        """Keep the workspace warm here for another host's executor (``standbys``)."""
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            devices = self.gpu_devices if gpus else ()
            return await self.standbys.keep(
                workspace_id, generation, list(kernels), snapshot, packages,
                (self.isolation.limits.over(limits), network, devices),
                workspace_id in self.runtimes)

    def _start_sync(self, runtime: Runtime) -> None:
        if self.file_sync_interval_s <= 0:
            return
        workspace_id = runtime.workspace_id
        loop = LiveSync(self.files, workspace_id, lambda: runtime.workdir,
                        lambda: runtime.manifest, lambda: self._owns(runtime),
                        self._lock(workspace_id), self.file_sync_interval_s, self.lease)
        runtime.file_sync = loop
        runtime.syncing = asyncio.create_task(loop.run(), name=f"file-sync-{workspace_id}")

    def _restore_layer(self, workspace_id: str, key: str | None, slot: Slot) -> dict[str, Any]:
        if key is None:
            return {"restored": False}
        try:
            restore_layer(self.blobs, workspace_id, key, slot.packages)
        except (CorruptSnapshot, OSError) as exc:
            log.warning("package layer of %s not restored: %s", workspace_id, exc)
            return {"restored": False, "error": str(exc)[:500]}
        return {"restored": True}

    async def add_kernel(self, workspace_id: str, generation: int, kernel_id: str,
                         name: str, env: dict[str, str] | None = None) -> KernelProcess:
        """``env``: ``KERNEL_*`` variables a gateway client asked for, already
        filtered (``protocol.kernel_env``): in a cold kernel's environment from its
        start, set in a claimed warm kernel before anyone reaches it."""
        env = env or {}
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            runtime = self.runtimes.get(workspace_id)
            if runtime is None:
                raise Conflict(f"workspace {workspace_id} has no runtime on this host")
            if kernel_id in runtime.kernels:
                return runtime.kernels[kernel_id]
            if not runtime.kernels and self._warm_fits(runtime.slot.limits, runtime.slot.network,
                                                       runtime.slot.devices):
                warm = self.pool.claim(name)
                if warm is not None and await self._give_env(warm, env) and await self._fit(
                        warm, runtime.slot.limits, adopt=runtime.slot):
                    # The runtime now lives in the warm kernel's slot.
                    await asyncio.to_thread(runtime.slot.remove)
                    runtime.slot = warm.slot
                    warm.kernel.rename(kernel_id, workspace_id)
                    self._register(runtime, warm.kernel)
                    return warm.kernel
            return await self._start_kernel(runtime, kernel_id, name, env)

    async def _give_env(self, warm: Warm, env: dict[str, str]) -> bool:
        """Set a claimed warm kernel's variables; one that does not take them is
        thrown away (the caller starts a kernel cold, with them)."""
        try:
            await warm.kernel.set_env(env)
        except Exception as exc:
            log.warning("warm kernel %s not used: %s", warm.kernel.id, exc)
            await self.pool.discard(warm)
            return False
        return True

    def _warm_fits(self, limits: Limits, network: str, devices: tuple[str, ...]) -> bool:
        """Whether a warm slot can serve a workspace: its disk was made at the default
        size, it has no network and it sees this host's GPUs, so a project with a
        quota of its own, or with internet access, and a workspace without GPUs on
        a host with real ones, get a slot of their own."""
        return (limits.disk_bytes == self.isolation.limits.disk_bytes and network == "none"
                and devices == self.gpu_devices)

    async def _fit(self, warm: Warm, limits: Limits, adopt: Slot | None = None) -> bool:
        """Give a claimed warm slot the workspace's limits (and, with ``adopt``, its
        files); a warm slot that cannot take them is thrown away, and the caller
        starts a kernel cold, the workspace's own slot untouched."""
        try:
            await asyncio.to_thread(warm.slot.apply, limits)
            if adopt is not None:
                await asyncio.to_thread(warm.slot.adopt, adopt)
        except OSError as exc:
            log.warning("warm slot %s not used: %s", warm.slot.name, exc)
            await self.pool.discard(warm)
            return False
        return True

    async def _start_kernel(self, runtime: Runtime, kernel_id: str, name: str,
                            env: dict[str, str] | None = None) -> KernelProcess:
        kernel = new_kernel(runtime.slot, kernel_id, runtime.workspace_id, name, self.sandbox,
                            env=env)
        try:
            await kernel.start()
        except BaseException:
            await kernel.shutdown()
            raise
        self._register(runtime, kernel)
        return kernel

    def _register(self, runtime: Runtime, kernel: KernelProcess) -> None:
        runtime.kernels[kernel.id] = kernel
        self.kernels[kernel.id] = kernel
        kernel.on_death = self._died
        kernel.bindings.on_release = self.on_released
        kernel.bindings.on_held = self.on_held
        if self.checkpoints is not None:
            self.checkpoints.watch(kernel)

    def runtime_generation(self, kernel: KernelProcess) -> int | None:
        """The generation of the runtime ``kernel`` runs in, or None once it left it
        (or the runtime was fenced off: its checkpoints would be refused anyway)."""
        runtime = self.runtimes.get(kernel.workspace_id)
        if runtime is None or runtime.kernels.get(kernel.id) is not kernel \
                or not self._owns(runtime):
            return None
        return runtime.generation

    def _died(self, kernel: KernelProcess, reason: str) -> None:
        self.deaths.append({"workspace_id": kernel.workspace_id, "kernel_id": kernel.id,
                            "reason": reason})
        del self.deaths[:-100]  # bounded: a kernel that keeps dying reports its latest

    async def remove_kernel(self, kernel_id: str) -> None:
        kernel = self.get_kernel(kernel_id)
        async with self._lock(kernel.workspace_id):
            runtime = self.runtimes.get(kernel.workspace_id)
            if runtime is not None:
                runtime.kernels.pop(kernel_id, None)
            self.kernels.pop(kernel_id, None)
            if self.checkpoints is not None:
                await self.checkpoints.forget(kernel)
            await kernel.shutdown()

    def get_kernel(self, kernel_id: str) -> KernelProcess:
        kernel = self.kernels.get(kernel_id)
        if kernel is None:
            raise NotFound(f"no kernel {kernel_id} on this host")
        return kernel

    # ----------------------------------------------------------------- fencing
    def _owns(self, runtime: Runtime) -> bool:
        """Whether ``runtime`` is still this host's to write from: registered, and
        not fenced off."""
        workspace_id = runtime.workspace_id
        return (self.runtimes.get(workspace_id) is runtime
                and self._fenced.get(workspace_id) is not runtime)

    def files_behind(self, now: float) -> tuple[float, dict[str, float]]:
        """How far the store is behind the files kernels write here, for the
        heartbeat: (the most that runtimes whose last sync left nothing unsynced
        lag behind, in seconds, which is about a sync interval), and for each
        runtime that has unsynced files, how long since the store held them all."""
        lag, behind = 0.0, {}
        for workspace_id, runtime in self.runtimes.items():
            sync = runtime.file_sync
            if sync is None:  # no live sync (--file-sync-interval 0)
                behind[workspace_id] = max(0.0, now - runtime.started)
                continue
            if sync.clean:
                lag = max(lag, now - sync.synced_at)
            else:
                behind[workspace_id] = max(0.0, now - sync.synced_at)
        return lag, behind

    def held(self) -> list[tuple[str, int]]:
        """(workspace id, generation) of each runtime here not fenced off yet: what
        the heartbeat reports."""
        return [(ws, runtime.generation) for ws, runtime in self.runtimes.items()
                if self._fenced.get(ws) is not runtime]

    def fence_off(self, stale: Iterable[str], reported: Mapping[str, int]) -> list[str]:
        """The control plane no longer places these workspaces here (a heartbeat's
        reply; ``reported``: the generations that heartbeat named). Synchronous, so
        the caller renews the lease only once their file syncs and checkpoints have
        stopped; each is then torn down without syncing its files back, which
        would overwrite what the workspace's new placement wrote. A runtime placed
        again since the heartbeat (another generation) is left alone. Returns the
        workspaces fenced off."""
        fenced = []
        for workspace_id in stale:
            runtime = self.runtimes.get(workspace_id)
            if runtime is None or runtime.generation != reported.get(workspace_id) \
                    or self._fenced.get(workspace_id) is runtime:
                continue
            log.warning("the control plane no longer places %s (generation %d) on this "
                        "host: dropping its runtime without syncing its files back",
                        workspace_id, runtime.generation)
            self._fenced[workspace_id] = runtime
            task = asyncio.create_task(self._drop(runtime), name=f"drop-{workspace_id}")
            self._drops.add(task)
            task.add_done_callback(self._drops.discard)
            fenced.append(workspace_id)
        return fenced

    async def _drop(self, runtime: Runtime) -> None:
        try:
            async with self._lock(runtime.workspace_id):
                if self.runtimes.get(runtime.workspace_id) is runtime:
                    await self._teardown(runtime, sync=False)
        except Exception:
            log.exception("could not drop the fenced-off runtime of %s", runtime.workspace_id)

    # --------------------------------------------------------------- releasing
    async def suspend(self, workspace_id: str, generation: int,
                      options: statesync.SuspendOptions) -> dict[str, Any] | None:
        """Save files, packages and kernel state, then release; None if no runtime.

        Everything is saved while the kernels still run. If any of it fails, the
        runtime is kept and :class:`SuspendFailed` is raised: a workspace is never
        half-suspended.
        """
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            runtime = self.runtimes.get(workspace_id)
            if runtime is None:
                return None
            notes = [note for kernel in runtime.kernels.values()
                     if (note := await statesync.quiesce(kernel, options))]
            try:
                flushed = [k for k in runtime.kernels.values() if await statesync.flush(k)]
                saved = await asyncio.to_thread(self._save, runtime, flushed)
            except statesync.FlushFailed as exc:
                raise SuspendFailed(f"could not save the workspace: {exc}"[:1000],
                                    runtime="kept") from exc
            except Exception as exc:
                log.warning("suspend of %s failed: %r", workspace_id, exc)
                raise SuspendFailed(f"could not save the workspace: {exc!r}"[:1000],
                                    runtime="kept") from exc
            self.pool.prepare(saved.pop("profile"))  # its resume is likely
            if self.release_delay_s:
                await asyncio.sleep(self.release_delay_s)
            await self._teardown(runtime, sync=False)
            saved["notes"] = notes
            return saved

    def _save(self, runtime: Runtime, flushed: list[KernelProcess]) -> dict[str, Any]:
        workspace_id = runtime.workspace_id
        kernels = {k.id: statesync.upload(self.blobs, workspace_id, k) for k in flushed}
        runtime.manifest = filesync.sync_back(
            self.files, workspace_id, runtime.workdir, runtime.manifest)
        packages = store_layer(self.blobs, workspace_id, runtime.slot.packages)
        # The import set its first kernel will need on resume (the one a warm kernel
        # serves), less what its own layer provides.
        first = next(iter(runtime.kernels), "")
        needs = preimports.snapshot_needs(
            self.blobs, workspace_id, {first: kernels[first]["key"]} if first in kernels else {},
            self.base_env, preimports.layer_modules(runtime.slot.packages))
        return {"kernels": kernels, "packages": packages,
                "bytes": sum(k["bytes"] for k in kernels.values()),
                "profile": needs[first].profile if first in needs else frozenset()}

    async def release(self, workspace_id: str, generation: int, sync: bool = True) -> bool:
        """Stop the kernels, sync files back, drop the runtime. False if there was none."""
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            runtime = self.runtimes.get(workspace_id)
            if runtime is None:
                return False
            if self.release_delay_s:
                await asyncio.sleep(self.release_delay_s)
            await self._teardown(runtime, sync)
            return True

    async def _teardown(self, runtime: Runtime, sync: bool) -> None:
        """Called with the workspace's lock held, so its file sync is never cut off
        while it writes the store (it waits for the lock, or sleeps, or scans)."""
        if runtime.syncing is not None:
            runtime.syncing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runtime.syncing
            runtime.syncing = None
        if self.checkpoints is not None:
            for kernel in runtime.kernels.values():
                await self.checkpoints.forget(kernel)
        await asyncio.gather(*(kernel.shutdown() for kernel in runtime.kernels.values()))
        for kernel_id in runtime.kernels:
            self.kernels.pop(kernel_id, None)
        runtime.kernels.clear()
        if sync:
            runtime.manifest = await asyncio.to_thread(
                filesync.sync_back, self.files, runtime.workspace_id, runtime.workdir,
                runtime.manifest,
            )
        if self.runtimes.get(runtime.workspace_id) is runtime:
            del self.runtimes[runtime.workspace_id]
        if self._fenced.get(runtime.workspace_id) is runtime:
            del self._fenced[runtime.workspace_id]
        await asyncio.to_thread(runtime.slot.remove)

    async def write_file(self, workspace_id: str, path: str, data: bytes | None) -> None:
        """Mirror an API write into a live runtime (``None`` deletes)."""
        async with self._lock(workspace_id):
            runtime = self.runtimes.get(workspace_id)
            if runtime is None:
                return
            if data is None:
                await asyncio.to_thread(filesync.remove_local, runtime.workdir, path)
                runtime.manifest.pop(path, None)
            else:
                runtime.manifest[path] = await asyncio.to_thread(
                    filesync.write_local, runtime.workdir, path, data, runtime.slot.owner)

    async def shutdown(self, sync: bool = True) -> None:
        """Agent exit: stop every kernel and save what the kernels wrote, except from
        a runtime fenced off. ``sync``: False when the agent exits without its
        lease (the control plane may have placed its workspaces elsewhere)."""
        await asyncio.gather(*self._drops, return_exceptions=True)
        await self.pool.shutdown()
        await self.standbys.shutdown()
        for runtime in list(self.runtimes.values()):
            try:
                async with self._lock(runtime.workspace_id):
                    if self.runtimes.get(runtime.workspace_id) is runtime:
                        await self._teardown(runtime, sync=sync and self._owns(runtime))
            except Exception:
                log.exception("could not tear down runtime %s", runtime.workspace_id)
