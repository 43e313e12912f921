"""Per-slot cgroups: memory, CPU and process limits, and who the OOM killer stopped.

Each slot (one workspace's runtime, or one warm kernel) gets a cgroup below the
agent's own: ``<agent's cgroup>/nbfleet-<agent id>/<slot>``, or below
``--cgroup-parent`` when an operator delegated a subtree to an unprivileged agent.
The sandbox's launcher writes its own pid into the slot's ``cgroup.procs`` before it
starts bubblewrap, so the kernel and everything it forks are counted from the
first instruction.

Both hierarchies are supported: cgroup v1 (one mount per controller, as on this
project's machines) and v2 (one unified tree; the agent moves itself into a leaf
so it may enable controllers for its children, as systemd's delegation expects).

On v1 a slot also gets a **device cgroup** where the ``devices`` controller is
mounted and the agent may write it (root): every device is refused but those
bubblewrap's ``/dev`` holds (``devices.BASE_RULES``) and the GPUs bound to the
slot now (:meth:`Cgroup.allow`, :meth:`Cgroup.deny`). v2 has no interface file for
it (an eBPF program would be needed): there, and for an unprivileged agent, no
device cgroup is made and a GPU slot's kernels can open every GPU node bound into
their ``/dev`` (``devices.py``; docs/security.md says what holds then).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass

from nbfleet.agent.sandbox.devices import BASE_RULES
from nbfleet.model.limits import Limits

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "cpu", "pids")
#: Optional: used where mounted and writable (v1).
DEVICES = "devices"
CPU_PERIOD_US = 100_000


class CgroupsUnavailable(RuntimeError):
    """No writable hierarchy with the memory, cpu and pids controllers."""


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _read_counter(path: str, key: str) -> int:
    try:
        with open(path) as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True, slots=True)
class Cgroup:
    """One slot's cgroup: a directory per v1 controller, or one v2 directory."""

    version: int
    dirs: tuple[str, ...]
    #: The slot's device cgroup (v1 ``devices``), or None where there is none.
    devices: str | None = None

    @property
    def procs_files(self) -> list[str]:
        extra = (self.devices,) if self.devices else ()
        return [os.path.join(d, "cgroup.procs") for d in (*self.dirs, *extra)]

    def allow(self, rules: list[str]) -> None:
        """Let the slot open these devices (``c MAJOR:MINOR rw``): one write each,
        cheap enough for the kernel's message loop."""
        if self.devices is not None:
            for rule in rules:
                _write(f"{self.devices}/devices.allow", rule)

    def deny(self, rules: list[str]) -> None:
        """Take the exceptions back: later opens fail with EPERM; what is open stays."""
        if self.devices is not None:
            for rule in rules:
                _write(f"{self.devices}/devices.deny", rule)

    def _dir(self, controller: str) -> str:
        """v1 keeps one directory per controller, in ``CONTROLLERS`` order."""
        return self.dirs[0] if self.version == 2 else self.dirs[CONTROLLERS.index(controller)]

    def apply(self, limits: Limits) -> None:
        """Set (or raise, or lift) the limits; safe on a running slot."""
        if self.version == 2:
            directory = self.dirs[0]
            _write(f"{directory}/memory.max", str(limits.memory_bytes or "max"))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                _write(f"{directory}/memory.swap.max", "0" if limits.memory_bytes else "max")
            quota = int(limits.cpus * CPU_PERIOD_US) if limits.cpus else "max"
            _write(f"{directory}/cpu.max", f"{quota} {CPU_PERIOD_US}")
            _write(f"{directory}/pids.max", str(limits.pids or "max"))
            return
        memory = self._dir("memory")
        value = str(limits.memory_bytes or -1)
        memsw = f"{memory}/memory.memsw.limit_in_bytes"
        if not os.path.exists(memsw):
            _write(f"{memory}/memory.limit_in_bytes", value)
        else:
            # memory+swap must stay >= memory: raise it first, lower it last.
            try:
                _write(f"{memory}/memory.limit_in_bytes", value)
            except OSError:
                _write(memsw, value)
                _write(f"{memory}/memory.limit_in_bytes", value)
            else:
                _write(memsw, value)
        cpu = self._dir("cpu")
        _write(f"{cpu}/cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(f"{cpu}/cpu.cfs_quota_us",
               str(int(limits.cpus * CPU_PERIOD_US) if limits.cpus else -1))
        _write(f"{self._dir('pids')}/pids.max", str(limits.pids or "max"))

    def oom_kills(self) -> int:
        """How many processes the OOM killer stopped in this cgroup so far."""
        if self.version == 2:
            return _read_counter(f"{self.dirs[0]}/memory.events", "oom_kill")
        return _read_counter(f"{self._dir('memory')}/memory.oom_control", "oom_kill")

    def remove(self) -> None:
        """Remove the directories; processes still inside are killed first."""
        for directory in (*self.dirs, *((self.devices,) if self.devices else ())):
            _remove_dir(directory)


def _kill_members(directory: str) -> None:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as handle:
            pids = [int(line) for line in handle if line.strip()]
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)


def _remove_dir(directory: str) -> None:
    """rmdir a cgroup (children first); a cgroup whose last process is still exiting
    refuses for a moment, so retry briefly."""
    if not os.path.isdir(directory):
        return
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            _remove_dir(entry.path)
    for attempt in range(50):
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == 49:
                log.warning("could not remove cgroup %s: %s", directory, exc)
                return
            _kill_members(directory)
            time.sleep(0.02)


def _v1_mounts() -> dict[str, tuple[str, ...]]:
    """v1 mount point -> its controllers (of ``CONTROLLERS`` and ``DEVICES``)."""
    found: dict[str, tuple[str, ...]] = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], fields[separator + 3]
            if fstype == "cgroup":
                found[fields[4]] = tuple(o for o in options.split(",")
                                         if o in (*CONTROLLERS, DEVICES))
    return {mount: ctrls for mount, ctrls in found.items() if ctrls}


def _v2_mount() -> str | None:
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            separator = fields.index("-")
            if fields[separator + 1] == "cgroup2":
                mount = fields[4]
                try:
                    with open(os.path.join(mount, "cgroup.controllers")) as ctl:
                        available = ctl.read().split()
                except OSError:
                    continue
                if all(c in available for c in CONTROLLERS):
                    return mount
    return None


def _own_paths() -> dict[str, str]:
    """Controller (or ``""`` for v2) -> this process's cgroup path."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


class CgroupTree:
    """Where this agent's slot cgroups live; one per agent process."""

    def __init__(self, version: int, roots: tuple[str, ...],
                 devices: str | None = None) -> None:
        self.version = version
        self.roots = roots
        #: Where the slots' device cgroups live (None: no device cgroups).
        self.devices = devices

    @classmethod
    def open(cls, local_id: str, parent: str | None = None) -> CgroupTree:
        """Find a writable hierarchy and make the agent's directory in it.

        ``parent`` (a cgroup path such as ``/nbfleet``) is a subtree delegated to this
        agent; by default the agent's own cgroup is the parent.
        """
        own = _own_paths()
        name = f"nbfleet-{local_id}"
        v1 = _v1_mounts()
        if all(any(c in ctrls for ctrls in v1.values()) for c in CONTROLLERS):
            roots = []
            for controller in CONTROLLERS:
                mount = next(m for m, ctrls in v1.items() if controller in ctrls)
                base = parent if parent is not None else own.get(controller, "/")
                roots.append(os.path.join(mount + base.rstrip("/"), name))
            tree = cls._made(1, tuple(roots))
            tree.devices = _devices_root(v1, own, parent, name)
            return tree
        unified = _v2_mount()
        if unified is None:
            raise CgroupsUnavailable("no cgroup hierarchy with the memory, cpu and pids "
                                     "controllers is mounted")
        base = unified + (parent if parent is not None else own.get("", "/")).rstrip("/")
        return cls._made(2, (_v2_delegate(base, name),))

    @classmethod
    def _made(cls, version: int, roots: tuple[str, ...]) -> CgroupTree:
        try:
            for root in roots:
                _remove_dir(root)  # a previous boot's leftovers
                os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise CgroupsUnavailable(f"cannot create {roots[0]}: {exc.strerror} (run the "
                                     f"agent as root, or delegate a cgroup subtree to it "
                                     f"and pass --cgroup-parent)") from exc
        return cls(version, roots)

    def create(self, name: str, limits: Limits) -> Cgroup:
        dirs = tuple(os.path.join(root, name) for root in self.roots)
        for directory in dirs:
            _remove_dir(directory)
            os.makedirs(directory)
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(dirs[0], "cgroup.subtree_control"), "")
        devices = None
        if self.devices is not None:
            devices = os.path.join(self.devices, name)
            _remove_dir(devices)
            os.makedirs(devices)
            # Refuse everything, then let bubblewrap's /dev through; GPUs are let
            # through while bound (the rules are set before any process joins).
            _write(f"{devices}/devices.deny", "a")
            for rule in BASE_RULES:
                _write(f"{devices}/devices.allow", rule)
        group = Cgroup(self.version, dirs, devices)
        group.apply(limits)
        return group

    def close(self) -> None:
        for root in (*self.roots, *((self.devices,) if self.devices else ())):
            _remove_dir(root)


def _devices_root(v1: dict[str, tuple[str, ...]], own: dict[str, str], parent: str | None,
                  name: str) -> str | None:
    """The agent's directory in the v1 devices hierarchy, or None (not mounted, or
    not writable: an unprivileged agent, whose delegated subtree rarely includes it)."""
    mount = next((m for m, ctrls in v1.items() if DEVICES in ctrls), None)
    if mount is None:
        return None
    base = parent if parent is not None else own.get(DEVICES, "/")
    root = os.path.join(mount + base.rstrip("/"), name)
    try:
        _remove_dir(root)
        os.makedirs(root, exist_ok=True)
        with open(f"{root}/devices.list") as handle:
            handle.read()
    except OSError as exc:
        log.info("no device cgroups (%s): GPU slots can open every GPU node", exc)
        return None
    return root


def _v2_delegate(base: str, name: str) -> str:
    """Make ``base/name`` with the controllers enabled for its children.

    A v2 cgroup with processes in it cannot enable controllers for its children
    ("no internal processes"), so the agent first moves itself into a leaf.
    """
    try:
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory +cpu +pids")
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise CgroupsUnavailable(f"cannot enable controllers in {base}: {exc.strerror}") \
                from exc
        leaf = os.path.join(base, "nbfleet-agent-leaf")
        os.makedirs(leaf, exist_ok=True)
        _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory +cpu +pids")
    root = os.path.join(base, name)
    _remove_dir(root)
    os.makedirs(root, exist_ok=True)
    _write(os.path.join(root, "cgroup.subtree_control"), "+memory +cpu +pids")
    return root
