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

With disk quotas (a root agent) the slot's root is a filesystem of the workspace's
disk limit, and the state lives on a second one, ``root/statefs/state/K``, sized
from the host's memory (``quota.state_disk_bytes``): a suspend never fails because
the user's files filled their quota. The agent stages downloads in ``root/statefs``
(its own, read-only in the sandbox), on the same filesystem as the state it replaces.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field

from jupyter_client.kernelspec import KernelSpecManager

from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.output import DEFAULT_OUTPUT_BUFFER_BYTES
from nbfleet.agent.sandbox import Isolation, Sandbox
from nbfleet.agent.sandbox.cgroups import Cgroup
from nbfleet.agent.sandbox.egress import Netns
from nbfleet.agent.sandbox.gpus import SlotGpus
from nbfleet.agent.sandbox.identity import Identities, Identity, hand_over
from nbfleet.agent.sandbox.quota import Disk, state_disk_bytes, unmount
from nbfleet.model.limits import Limits, format_size
from nbfleet.protocol.kernel_env import allowed_kernel_env

#: Environment variables a kernel may inherit. Everything else, the control plane's
#: secrets included, is withheld from user code.
_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")

#: Imported by warm kernels before any workspace claims them.
WARM_IMPORTS = ("numpy", "pandas")


def kernel_env(home: str) -> dict[str, str]:
    """What every kernel starts with. Nothing a standard ipykernel would not have:
    no ``MPLBACKEND``, so ipykernel picks matplotlib's inline backend itself and a
    figure shows as an ``image/png`` in the notebook."""
    env = {name: os.environ[name] for name in _INHERITED_ENV if name in os.environ}
    venv_bin = os.path.dirname(sys.executable)
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(
        HOME=home,
        USER="nbfleet",  # the sandbox's uid has no passwd entry; getpass asks $USER first
        TMPDIR="/tmp",  # private to the kernel inside the sandbox
        PYTHONUNBUFFERED="1",
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


@dataclass(eq=False)
class Slot:
    name: str
    root: str
    sockets: str  # short path: IPC socket paths must fit in 107 bytes
    identity: Identity | None = None
    cgroup: Cgroup | None = None
    disk: Disk | None = None
    #: The filesystem the kernels' state is written to (with ``disk``).
    state_disk: Disk | None = None
    limits: Limits = field(default_factory=Limits)
    identities: Identities | None = None
    #: A tmpfs mounted on the socket directory (root agents with quotas).
    ipc_mount: bool = False
    #: The network namespace with internet access (a project in egress mode).
    netns: Netns | None = None
    #: Device nodes its kernels see: the host's GPUs for a workspace that asks for
    #: GPUs. Which of them a cell may open is its binding's: the slot's device
    #: cgroup, changed at each bind and release (``gpus``).
    devices: tuple[str, ...] = ()
    #: Which of the host's GPUs it may open now (None: it has no GPU nodes).
    gpus: SlotGpus | None = None
    #: The output its kernels keep for their clients (``agent.output``).
    output_buffer_bytes: int = DEFAULT_OUTPUT_BUFFER_BYTES
    _oom_seen: int = 0

    @classmethod
    def create(cls, runtimes_dir: str, sockets_dir: str, name: str,
               isolation: Isolation | None = None, limits: Limits | None = None,
               network: str = "none", devices: tuple[str, ...] = ()) -> Slot:
        """Make the slot's directories, and with ``isolation`` its uid, cgroup and disk.

        Half-made slots are removed again: nothing is left behind on failure.
        """
        isolation = isolation or Isolation(None)
        limits = limits or isolation.limits
        slot = cls(name, os.path.join(runtimes_dir, name), os.path.join(sockets_dir, name),
                   limits=limits, identities=isolation.identities, devices=devices)
        try:
            shutil.rmtree(slot.root, ignore_errors=True)  # a previous boot's leftovers
            if isolation.quotas is not None and limits.disk_bytes:
                isolation.quotas.check_reserve()
                slot.disk = isolation.quotas.create(name, slot.root, limits.disk_bytes)
            # The slot's root and socket directory stay the agent's (and the sandbox
            # sees them read-only): the kernel cannot rename what is bound into its
            # view, nor replace its connection file, between two starts.
            os.makedirs(slot.root, exist_ok=True)
            os.chmod(slot.root, 0o755)
            if slot.disk is not None:
                assert isolation.quotas is not None
                statefs = os.path.join(slot.root, "statefs")
                slot.state_disk = isolation.quotas.create(
                    f"{name}-state", statefs, state_disk_bytes(limits.memory_bytes),
                    few_files=True)
                os.chmod(statefs, 0o755)
            for path in (*slot.owned, slot.sockets):
                os.makedirs(path, exist_ok=True)
            os.chmod(slot.sockets, 0o755)
            if isolation.identities is not None:
                slot.identity = isolation.identities.allocate()
            if isolation.quotas is not None and slot.identity is not None:
                # Socket files live on the host's /tmp: a tiny tmpfs keeps the kernel
                # from storing anything else there, past its disk quota.
                slot.ipc_mount = isolation.quotas.small_tmpfs(slot.ipc, slot.identity.uid)
            slot.hand_over()
            if network == "egress" and isolation.egress is not None:
                slot.netns = isolation.egress.create(name)
            if isolation.cgroups is not None:
                slot.cgroup = isolation.cgroups.create(name, limits)
                slot._oom_seen = slot.cgroup.oom_kills()
            if devices and isolation.gpus is not None:
                slot.gpus = isolation.gpus.slot(slot.cgroup)
        except BaseException:
            slot.remove()
            raise
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
    def stage(self) -> str:
        """Where the agent stages a kernel's state before renaming it into place:
        the agent's directory on the state's filesystem."""
        return os.path.join(self.root, "statefs") if self.state_disk else self.root

    @property
    def state(self) -> str:
        return os.path.join(self.stage, "state")

    @property
    def ipc(self) -> str:
        """Where the kernel's IPC sockets are made: the only part of the socket
        directory the sandbox may write."""
        return os.path.join(self.sockets, "ipc")

    @property
    def owned(self) -> tuple[str, ...]:
        """The directories the sandbox's uid owns and may write."""
        return (self.files, self.home, self.packages, self.state, self.tmp, self.ipc)

    @property
    def tmp(self) -> str:
        """The sandbox's /tmp: on the slot's own disk, so it counts against its quota."""
        return os.path.join(self.root, "tmp")

    def hand_over(self, path: str | None = None) -> None:
        """Give what the agent wrote into the slot (by default: into every directory
        the sandbox owns) to the sandbox's uid."""
        for owned in (path,) if path else self.owned:
            hand_over(owned, self.identity)

    @property
    def owner(self) -> tuple[int, int] | None:
        """The sandbox's (uid, gid) when it runs as a uid of its own."""
        return (self.identity.uid, self.identity.gid) if self.identity else None

    def apply(self, limits: Limits) -> None:
        """Change a live slot's limits (a warm slot claimed by a workspace whose
        project sets its own). The disk keeps the size it was made with."""
        self.limits = limits
        if self.cgroup is not None:
            self.cgroup.apply(limits)

    def death_reason(self) -> str | None:
        """Why the kernel in this slot just died, when the platform knows: the OOM
        killer stopped it at the memory limit."""
        if self.cgroup is None:
            return None
        kills = self.cgroup.oom_kills()
        if kills <= self._oom_seen:
            return None
        self._oom_seen = kills
        limit = self.limits.memory_bytes
        return ("the kernel was stopped: it used its "
                f"{format_size(limit) if limit else 'whole'} memory limit")

    @property
    def network(self) -> str:
        return "egress" if self.netns is not None else "none"

    def remove(self) -> None:
        if self.netns is not None:
            self.netns.remove()
        if self.ipc_mount:
            unmount(self.ipc)
        for disk in (self.state_disk, self.disk):  # the state's is mounted in the other
            if disk is not None:
                disk.remove()
        if self.cgroup is not None:
            self.cgroup.remove()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.sockets, ignore_errors=True)
        if self.identity is not None and self.identities is not None:
            self.identities.release(self.identity)

    def adopt(self, other: Slot) -> None:
        """Take another slot's files and packages (a slot with no kernel running),
        owned by this slot's uid: renamed where both slots share a filesystem, else
        copied, so that a copy that fails (this slot's quota) leaves ``other`` whole."""
        for mine, theirs in ((self.files, other.files), (self.packages, other.packages)):
            same = os.stat(mine).st_dev == os.stat(theirs).st_dev
            for entry in os.listdir(theirs):
                source, target = os.path.join(theirs, entry), os.path.join(mine, entry)
                if same:
                    os.replace(source, target)
                elif os.path.isdir(source) and not os.path.islink(source):
                    shutil.copytree(source, target, symlinks=True)
                else:
                    shutil.copy2(source, target, follow_symlinks=False)
        self.hand_over()


@dataclass(frozen=True, slots=True)
class KernelPaths:
    """Where a kernel finds its workspace's directories."""

    files: str
    home: str
    packages: str
    state: str


#: The fixed layout in the sandbox: the same in every slot, so a path a notebook
#: holds (``os.getcwd()``, ``Path("data.csv").resolve()``, ``sys.path``, a module's
#: ``__file__``) stays true after a resume, a move or a failover, and no path of the
#: host's shows. Under /home, which the sandbox hides under a fresh tmpfs of its own.
#: No mount point lies inside a directory the tenant can write: the root agent's
#: bubblewrap makes them, and follows symlinks in their paths, so a link a kernel
#: planted in its home (``~/work -> /usr/bin``) would have it bind the tenant's
#: files over the host's programs in the view where it then runs ``setpriv``.
INSIDE = KernelPaths(files="/home/work", home="/home/nbfleet",
                     packages="/home/.nbfleet/packages", state="/home/.nbfleet/state")


def kernel_paths(slot: Slot, sandbox: Sandbox | None) -> tuple[KernelPaths,
                                                               tuple[tuple[str, str], ...]]:
    """The paths a kernel in ``slot`` sees, and the (host, inside) binds that make
    them: the fixed layout in a sandbox that allows it, else the host's own."""
    if sandbox is None or not sandbox.stable_paths:
        return KernelPaths(slot.files, slot.home, slot.packages, slot.state), ()
    return INSIDE, ((slot.home, INSIDE.home), (slot.files, INSIDE.files),
                    (slot.packages, INSIDE.packages), (slot.state, INSIDE.state))


def new_kernel(slot: Slot, kernel_id: str, workspace_id: str, name: str,
               sandbox: Sandbox | None, preimport: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> KernelProcess:
    """A kernel process (not started) that runs in ``slot`` and captures its state.

    ``env``: a client's ``KERNEL_*`` variables, filtered by
    ``protocol.kernel_env`` (never a name the platform sets itself)."""
    extra_env = allowed_kernel_env(env)
    seen, moved = kernel_paths(slot, sandbox)
    env = kernel_env(seen.home)
    extra: tuple[str, ...] = ()
    name_of_state = uuid.uuid4().hex[:12]
    state_dir = os.path.join(slot.state, name_of_state)
    if is_ipykernel(name):
        os.makedirs(state_dir, exist_ok=True)
        slot.hand_over(state_dir)
        extra = ("--ext", "nbfleet.kernel")
        env.update(
            NBFLEET_STATE_DIR=os.path.join(seen.state, name_of_state),
            PYTHONPATH=seen.packages,
            # %pip and !pip install into the workspace's layer, not the base environment.
            PIP_TARGET=seen.packages,
            PIP_DISABLE_PIP_VERSION_CHECK="1",
        )
        if preimport:
            env["NBFLEET_PREIMPORT"] = ",".join(preimport)
    env.update(extra_env)
    kernel = KernelProcess(kernel_id, workspace_id, name, slot.files, env, slot.sockets,
                           sandbox=sandbox,
                           visible=() if moved else (slot.home, slot.packages, slot.state),
                           readonly=() if moved else (slot.root,), moved=moved,
                           ipc_dir=slot.ipc, extra_arguments=extra,
                           tmp=slot.tmp, identity=slot.identity, cgroup=slot.cgroup,
                           netns=slot.netns.path if slot.netns else None,
                           devices=slot.devices, output_buffer_bytes=slot.output_buffer_bytes)
    kernel.bindings.gpus = slot.gpus
    kernel.state_dir = state_dir if extra else None
    kernel.staging_root = slot.stage
    kernel.death_reason = slot.death_reason
    return kernel
