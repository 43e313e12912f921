"""Slots: the directories a runtime lives in, and how kernels are launched in them.

A kernel sees only its slot (the sandbox binds the slot's root and socket
directory), so a kernel started in a slot before any workspace claims it (a warm
kernel) can become any workspace's kernel: the workspace's files, package layer and
state are written into the slot it claims.

Layout of a slot::

    root/files      the working directory, a cache of the workspace's files
    root/home       $HOME
    root/packages   the workspace's package layer: on sys.path, and pip's target
    root/state/K    kernel K's captured state (``nbfleet.kernel``)
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from dataclasses import dataclass

from jupyter_client.kernelspec import KernelSpecManager

from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.sandbox import Sandbox

#: Environment variables a kernel may inherit. Everything else, the control plane's
#: secrets included, is withheld from user code.
_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")

#: Imported by warm kernels before any workspace claims them.
WARM_IMPORTS = ("numpy", "pandas")


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


def is_ipykernel(kernel_name: str) -> bool:
    """Only IPython kernels can load the state-capture extension."""
    try:
        argv = KernelSpecManager().get_kernel_spec(kernel_name).argv
    except Exception:  # unknown spec: the kernel manager reports it on start
        return False
    return any("ipykernel" in part for part in argv)


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    root: str
    sockets: str  # short path: IPC socket paths must fit in 107 bytes

    @classmethod
    def create(cls, runtimes_dir: str, sockets_dir: str, name: str) -> Slot:
        slot = cls(name, os.path.join(runtimes_dir, name), os.path.join(sockets_dir, name))
        shutil.rmtree(slot.root, ignore_errors=True)  # a previous boot's leftovers
        for path in (slot.files, slot.home, slot.packages, slot.state):
            os.makedirs(path, exist_ok=True)
        os.makedirs(slot.sockets, mode=0o700, exist_ok=True)
        return slot

    @property
    def files(self) -> str:
        return os.path.join(self.root, "files")

    @property
    def home(self) -> str:
        return os.path.join(self.root, "home")

    @property
    def packages(self) -> str:
        return os.path.join(self.root, "packages")

    @property
    def state(self) -> str:
        return os.path.join(self.root, "state")

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)

    def adopt(self, other: Slot) -> None:
        """Move another slot's files and packages here (same filesystem: renames only)."""
        for mine, theirs in ((self.files, other.files), (self.packages, other.packages)):
            for entry in os.listdir(theirs):
                os.replace(os.path.join(theirs, entry), os.path.join(mine, entry))


def new_kernel(slot: Slot, kernel_id: str, workspace_id: str, name: str,
               sandbox: Sandbox | None, preimport: tuple[str, ...] = ()) -> KernelProcess:
    """A kernel process (not started) that runs in ``slot`` and captures its state."""
    env = kernel_env(slot.home)
    extra: tuple[str, ...] = ()
    state_dir = os.path.join(slot.state, uuid.uuid4().hex[:12])
    if is_ipykernel(name):
        os.makedirs(state_dir, exist_ok=True)
        extra = ("--ext", "nbfleet.kernel")
        env.update(
            NBFLEET_STATE_DIR=state_dir,
            PYTHONPATH=slot.packages,
            # %pip and !pip install into the workspace's layer, not the base environment.
            PIP_TARGET=slot.packages,
            PIP_DISABLE_PIP_VERSION_CHECK="1",
        )
        if preimport:
            env["NBFLEET_PREIMPORT"] = ",".join(preimport)
    kernel = KernelProcess(kernel_id, workspace_id, name, slot.files, env, slot.sockets,
                           sandbox=sandbox, visible=(slot.root,), extra_arguments=extra)
    kernel.state_dir = state_dir if extra else None
    return kernel
