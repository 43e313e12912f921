"""Workspace runtimes on this host: a working directory plus the workspace's kernels.

Every command carries the workspace generation. The agent remembers the highest
generation it has seen per workspace and refuses older commands, so a delayed
"place" can never resurrect a runtime that a newer "release" removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from nbfleet.agent import filesync
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.sandbox import Sandbox
from nbfleet.model.errors import Conflict, NotFound
from nbfleet.storage.files import WorkspaceFiles

log = logging.getLogger(__name__)

#: Environment variables a kernel may inherit. Everything else, the control plane's
#: secrets included, is withheld from user code.
_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


def kernel_env(home: str) -> dict[str, str]:
    env = {name: os.environ[name] for name in _INHERITED_ENV if name in os.environ}
    venv_bin = os.path.dirname(sys.executable)
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(
        HOME=home,
        TMPDIR="/tmp",  # private to the kernel inside the sandbox
        PYTHONUNBUFFERED="1",
        MPLBACKEND="agg",
        PYDEVD_DISABLE_FILE_VALIDATION="1",  # silences debugpy's frozen-modules warning
    )
    return env


@dataclass
class Runtime:
    workspace_id: str
    generation: int
    root: str
    sockets: str  # short path: IPC socket paths must fit in 107 bytes
    manifest: filesync.Manifest = field(default_factory=dict)
    kernels: dict[str, KernelProcess] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def workdir(self) -> str:
        return os.path.join(self.root, "files")

    @property
    def home(self) -> str:
        return os.path.join(self.root, "home")


class RuntimeManager:
    def __init__(self, state_dir: str, files: WorkspaceFiles, sockets_dir: str,
                 sandbox: Sandbox | None = None, release_delay_s: float = 0.0) -> None:
        self.state_dir = state_dir
        self.sockets_dir = sockets_dir
        self.sandbox = sandbox
        self.files = files
        self.runtimes: dict[str, Runtime] = {}
        self.kernels: dict[str, KernelProcess] = {}
        self._generations: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: Fault injection for crash tests: hold a release open this long.
        self.release_delay_s = release_delay_s

    def _lock(self, workspace_id: str) -> asyncio.Lock:
        return self._locks.setdefault(workspace_id, asyncio.Lock())

    def _fence(self, workspace_id: str, generation: int) -> None:
        seen = self._generations.get(workspace_id, 0)
        if generation < seen:
            raise Conflict(
                f"stale command for {workspace_id}: generation {generation} < {seen}",
                current_generation=seen,
            )
        self._generations[workspace_id] = generation

    async def ensure(self, workspace_id: str, generation: int,
                     kernels: Iterable[tuple[str, str]]) -> Runtime:
        """Make the runtime exist with exactly these kernels running (idempotent)."""
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            runtime = self.runtimes.get(workspace_id)
            if runtime is None:
                root = os.path.join(self.state_dir, "runtimes", workspace_id)
                sockets = os.path.join(self.sockets_dir, workspace_id)
                runtime = Runtime(workspace_id, generation, root, sockets)
                os.makedirs(runtime.home, exist_ok=True)
                os.makedirs(sockets, mode=0o700, exist_ok=True)
                runtime.manifest = await asyncio.to_thread(
                    filesync.materialize, self.files, workspace_id, runtime.workdir
                )
                self.runtimes[workspace_id] = runtime
            runtime.generation = generation
            for kernel_id, name in kernels:
                if kernel_id not in runtime.kernels:
                    await self._start_kernel(runtime, kernel_id, name)
            return runtime

    async def add_kernel(self, workspace_id: str, generation: int, kernel_id: str,
                         name: str) -> KernelProcess:
        async with self._lock(workspace_id):
            self._fence(workspace_id, generation)
            runtime = self.runtimes.get(workspace_id)
            if runtime is None:
                raise Conflict(f"workspace {workspace_id} has no runtime on this host")
            if kernel_id in runtime.kernels:
                return runtime.kernels[kernel_id]
            return await self._start_kernel(runtime, kernel_id, name)

    async def _start_kernel(self, runtime: Runtime, kernel_id: str, name: str) -> KernelProcess:
        kernel = KernelProcess(
            kernel_id,
            runtime.workspace_id,
            name,
            runtime.workdir,
            kernel_env(runtime.home),
            runtime.sockets,
            sandbox=self.sandbox,
            visible=(runtime.home,),
        )
        try:
            await kernel.start()
        except BaseException:
            await kernel.shutdown()
            raise
        runtime.kernels[kernel_id] = kernel
        self.kernels[kernel_id] = kernel
        return kernel

    async def remove_kernel(self, kernel_id: str) -> None:
        kernel = self.get_kernel(kernel_id)
        async with self._lock(kernel.workspace_id):
            runtime = self.runtimes.get(kernel.workspace_id)
            if runtime is not None:
                runtime.kernels.pop(kernel_id, None)
            self.kernels.pop(kernel_id, None)
            await kernel.shutdown()

    def get_kernel(self, kernel_id: str) -> KernelProcess:
        kernel = self.kernels.get(kernel_id)
        if kernel is None:
            raise NotFound(f"no kernel {kernel_id} on this host")
        return kernel

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
        await asyncio.gather(*(kernel.shutdown() for kernel in runtime.kernels.values()))
        for kernel_id in runtime.kernels:
            self.kernels.pop(kernel_id, None)
        runtime.kernels.clear()
        if sync:
            runtime.manifest = await asyncio.to_thread(
                filesync.sync_back, self.files, runtime.workspace_id, runtime.workdir,
                runtime.manifest,
            )
        self.runtimes.pop(runtime.workspace_id, None)
        await asyncio.to_thread(shutil.rmtree, runtime.root, True)
        await asyncio.to_thread(shutil.rmtree, runtime.sockets, True)

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
                runtime.manifest[path] = filesync.write_local(runtime.workdir, path, data)

    async def shutdown(self) -> None:
        """Agent exit: stop every kernel and save what the kernels wrote."""
        for runtime in list(self.runtimes.values()):
            try:
                await self._teardown(runtime, sync=True)
            except Exception:
                log.exception("could not tear down runtime %s", runtime.workspace_id)
