"""NVIDIA's device nodes: which ones this host has, the device-cgroup rules that let
a slot open them, and which of them a slot's processes still hold.

A GPU is reached through its character device: ``/dev/nvidiaN`` (major 195,
minor N) for GPU N, plus control nodes every GPU process needs (``/dev/nvidiactl``,
195:255; ``/dev/nvidia-uvm`` and ``nvidia-uvm-tools``, whose major the driver picks at
load time; ``/dev/nvidia-modeset``; the MIG capabilities under ``/dev/nvidia-caps``).
Binding a node into the sandbox makes it visible; the slot's device cgroup
(``cgroups.Cgroup.allow``) decides whether an ``open`` of it succeeds, and is
changed at every bind and release (``gpus.SlotGpus``).

The cgroup is checked at ``open`` only: a file descriptor opened while the GPU was
bound, or a mapping made through it, keeps working after the release. That is why
a release asks :func:`held` which of the released nodes a slot's processes still
have open or mapped.

``$NBFLEET_GPU_DEVICE_DIR`` names another directory than ``/dev`` to find the nodes
in: the tests make character devices with NVIDIA's numbers in a directory of their
own; the sandbox shows them under ``/dev`` as the real ones.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

#: Where the nodes are looked for instead of /dev (tests).
DEVICE_DIR_ENV = "NBFLEET_GPU_DEVICE_DIR"
NVIDIA_MAJOR = 195

#: What bubblewrap's ``--dev`` gives every sandbox (null, zero, full, random, urandom,
#: tty, and a devpts of its own with its ptmx): allowed in every slot's device cgroup,
#: read and write, never mknod. Everything else is refused unless a GPU is bound.
BASE_RULES = ("c 1:3 rw", "c 1:5 rw", "c 1:7 rw", "c 1:8 rw", "c 1:9 rw",
              "c 5:0 rw", "c 5:2 rw", "c 136:* rw")

_GPU_NAME = re.compile(r"nvidia(\d+)")


@dataclass(frozen=True, slots=True)
class GpuNode:
    """One character device of NVIDIA's."""

    #: On the host (under the device directory).
    path: str
    major: int
    minor: int
    #: The GPU it is (``nvidiaN``), or None for a control node every GPU needs.
    index: int | None
    #: The node's own inode, which ``/proc/<pid>/maps`` names a mapping of it by.
    inode: tuple[int, int] = (0, 0)

    @property
    def rule(self) -> str:
        return f"c {self.major}:{self.minor} rw"

    @property
    def rdev(self) -> int:
        return os.makedev(self.major, self.minor)


def device_dir() -> str:
    return os.environ.get(DEVICE_DIR_ENV) or "/dev"


def gpu_paths(directory: str | None = None) -> list[str]:
    """The entries to bind into a GPU slot's ``/dev`` (``nvidia-caps`` is a directory)."""
    root = directory or device_dir()
    with contextlib.suppress(OSError):
        return sorted(os.path.join(root, name) for name in os.listdir(root)
                      if name.startswith("nvidia"))
    return []


def gpu_nodes(directory: str | None = None) -> tuple[GpuNode, ...]:
    """Every NVIDIA character device this host has (none without GPUs)."""
    found: list[GpuNode] = []
    for path in gpu_paths(directory):
        candidates = [path]
        if os.path.isdir(path) and not os.path.islink(path):
            candidates = [os.path.join(path, n) for n in sorted(os.listdir(path))]
        for candidate in candidates:
            try:
                st = os.stat(candidate)
            except OSError:
                continue
            if not stat.S_ISCHR(st.st_mode):
                continue
            match = _GPU_NAME.fullmatch(os.path.basename(candidate))
            index = int(match.group(1)) if match and os.path.dirname(candidate) == \
                os.path.dirname(path) else None
            found.append(GpuNode(candidate, os.major(st.st_rdev), os.minor(st.st_rdev),
                                 index, (st.st_dev, st.st_ino)))
    return tuple(found)


def cgroup_pids(procs_files: Iterable[str]) -> set[int]:
    """The processes in a slot's cgroup (every hierarchy has all of them)."""
    for path in procs_files:
        try:
            with open(path) as handle:
                return {int(line) for line in handle if line.strip()}
        except (OSError, ValueError):
            continue
    return set()


def held(pids: Iterable[int], nodes: Iterable[GpuNode]) -> set[GpuNode]:
    """Those of ``nodes`` that any of ``pids`` has open (a file descriptor, ``O_PATH``
    ones included: counted, though they cannot reach the device) or mapped.

    It reads ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``: run it off the event loop
    (a hostile slot can hold many descriptors). A process that exits meanwhile holds
    nothing; one the agent may not inspect is counted as holding all of them.
    """
    wanted = list(nodes)
    by_rdev = {node.rdev: node for node in wanted}
    by_inode = {node.inode: node for node in wanted}
    found: set[GpuNode] = set()
    for pid in pids:
        if len(found) == len(wanted):
            break
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        except PermissionError:
            return set(wanted)
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev in by_rdev:
                found.add(by_rdev[st.st_rdev])
        found |= _mapped(pid, by_inode)
    return found


def _mapped(pid: int, by_inode: dict[tuple[int, int], GpuNode]) -> set[GpuNode]:
    found: set[GpuNode] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as handle:
        for line in handle:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[4] == "0":
                continue
            major, _, minor = fields[3].partition(":")
            with contextlib.suppress(ValueError):
                key = (os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
                if key in by_inode:
                    found.add(by_inode[key])
    return found
