"""The command line that starts user code (a kernel or a job) in its sandbox.

Every sandboxed process gets, from bubblewrap:

- its own **user namespace** with no capabilities and ``no_new_privs``; a root agent
  also switches to the slot's own unprivileged host uid first (``setpriv``), so the
  sandbox is never root nor the agent outside its namespace;
- its own **PID namespace**: it sees and signals only its own processes, and
  ``/proc/<host pid>`` does not exist for it;
- its own **mount namespace**: the host read-only, the agent's state, the control
  plane's home, the other slots, home directories and ``/tmp`` hidden under empty
  tmpfs mounts; only its slot (files, packages, home, a private ``/tmp``) writable;
- its own **network namespace** with nothing but a loopback of its own: the agent
  is reached through the kernel's ZMQ IPC sockets (files in its socket directory);
- IPC and UTS namespaces, and the **seccomp filter** of ``seccomp.py``;
- a **cgroup** with the slot's limits, joined by the launcher before bubblewrap starts,
  and where there is one a **device cgroup** that lets it open only the GPUs bound
  to its slot now (``gpus.py``).

A root agent runs bubblewrap twice. The outer one (privileged) builds the mount
view, where it may hide directories the sandbox uid could not even traverse (the
Python of a ``/root/.pyenv`` lives under a 0700 ``/root``); ``setpriv`` then drops to
the slot's uid with no capabilities; the inner one (unprivileged) makes the user,
PID, network, IPC and UTS namespaces and applies the filter. An unprivileged agent
runs only the inner one.

Every sandboxed process dies with the agent, a kill -9 included: no kernel or job
is left holding memory or a GPU that the agent's next boot knows nothing of.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from nbfleet.agent.sandbox.cgroups import Cgroup
from nbfleet.agent.sandbox.identity import INNER_ID, Identity

#: Size of the private /tmp when the slot has no disk of its own (jobs, or hosts
#: without quotas); a tmpfs is memory, counted against the memory limit.
TMPFS_BYTES = 256 << 20
#: The launcher's file descriptor for the compiled seccomp filter.
SECCOMP_FD = 3


@dataclass(frozen=True, slots=True)
class Sandbox:
    bwrap: str
    #: Directories no sandbox may see (the agent's state, the control plane's home,
    #: the socket directories, home directories), each covered by an empty tmpfs.
    hidden: tuple[str, ...]
    #: Read-only paths bound back over hidden ones: the Python environment, when it
    #: happens to live under /tmp, /root or another hidden directory.
    readonly: tuple[str, ...] = ()
    #: True when the agent is root: the outer bubblewrap and the uid switch.
    privileged: bool = False
    #: The compiled filter (``seccomp.write_filter``); None where libseccomp is missing.
    seccomp: str | None = None
    setpriv: str = "/usr/bin/setpriv"
    #: An empty file of the agent's, bound over hidden files (a device node such as
    #: /dev/null cannot be: bubblewrap's binds are nodev).
    empty_file: str | None = None
    #: Bound over /etc/resolv.conf in a namespace with internet access.
    resolv_conf: str | None = None

    @property
    def stable_paths(self) -> bool:
        """Whether a workspace's directories can be bound at fixed paths under
        ``/home`` (``slots.INSIDE``): bubblewrap can make mount points there only
        when /home is hidden under a tmpfs of the sandbox's own."""
        return "/home" in self.hidden

    def wrap(self, argv: list[str], visible: list[str], workdir: str, *,
             tmp: str | None = None, identity: Identity | None = None,
             cgroup: Cgroup | None = None, devices: list[str] | None = None,
             job: bool = False, readonly: list[str] | None = None,
             netns: str | None = None,
             moved: Sequence[tuple[str, str]] = ()) -> list[str]:
        """``argv`` inside the sandbox.

        ``visible`` are the directories bound writable (the slot, the socket
        directory); ``tmp`` becomes ``/tmp`` (else a small tmpfs); ``devices`` are
        device nodes to pass through (a job's GPUs); ``readonly`` more paths bound
        back read-only (a job's binary under a hidden path); ``netns`` a network
        namespace with internet access to enter instead of an empty one of its own
        (``egress.py``); ``moved`` (host path, path inside) pairs bound writable at
        a path of the sandbox's own (a workspace's fixed layout, ``stable_paths``),
        in order, so that one may sit inside another. Under bwrap a child killed by
        signal N ends the sandbox with exit status 128 + N.
        """
        view = self._view(visible, tmp, readonly or [], moved)
        inner = self._namespaces(own_network=netns is None)
        if netns is not None and self.resolv_conf is not None:
            view += ["--ro-bind", self.resolv_conf, "/etc/resolv.conf"]
        if not self.privileged:
            command = [self.bwrap, *inner, "--ro-bind", "/", "/", "--proc", "/proc",
                       "--dev", "/dev", *view, *self._devices(devices or []), *self._tail(workdir)]
        else:
            # The host's /dev, bound read-only, would be nodev (every device node,
            # /dev/null included, refused): a /dev of its own, with the GPUs given.
            # A PID namespace of its own ties the sandbox to the agent: behind the
            # uid switch the inner bubblewrap's --die-with-parent did not fire (its
            # processes outlived a kill -9 of the agent; without the switch they
            # did not, measured with bubblewrap 0.8). The namespace's init dies
            # with the outer one (--die-with-parent), and the kernel then ends every
            # process in it. /proc stays the host's: the inner one mounts its own.
            outer = [self.bwrap, "--unshare-pid", "--ro-bind", "/", "/",
                     "--bind", "/proc", "/proc",
                     "--dev", "/dev", *self._devices(devices or []), *view,
                     "--die-with-parent", "--"]
            drop = [self.setpriv]
            if identity is not None:
                drop += [f"--reuid={identity.uid}", f"--regid={identity.gid}", "--clear-groups"]
            drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
            command = [*outer, *drop, self.bwrap, *inner, "--bind", "/", "/",
                       "--proc", "/proc", "--dev", "/dev",
                       *self._devices(devices or [], inner=True),
                       *self._tail(workdir)]
        if netns is not None:
            command = ["nsenter", f"--net={netns}", "--", *command]
        if job:
            # bwrap ignores INT and TERM (ignoring survives exec) so that a stop gives
            # the binary its grace period; `env --default-signal` restores them for it.
            command += ["env", "--default-signal=INT,TERM"]
        return [*self._launcher(cgroup, job), *command, *argv]

    def _launcher(self, cgroup: Cgroup | None, job: bool) -> list[str]:
        """The shell that joins the cgroup, opens the filter and ignores SIGINT
        (interrupts go to the whole process group, which would kill bwrap and, by
        --die-with-parent, the kernel; ipykernel sets its own SIGINT handler)."""
        steps = ["set -e"]
        steps += [f"echo $$ > {shlex.quote(path)}" for path in (cgroup.procs_files
                                                                if cgroup else [])]
        if self.seccomp is not None:
            steps.append(f"exec {SECCOMP_FD}<{shlex.quote(self.seccomp)}")
        steps += ['trap "" INT TERM' if job else 'trap "" INT', 'exec "$@"']
        return ["/bin/sh", "-c", "; ".join(steps), "nbfleet-sandbox"]

    def _view(self, visible: list[str], tmp: str | None, readonly: list[str],
              moved: Sequence[tuple[str, str]] = ()) -> list[str]:
        view: list[str] = []
        if tmp is not None:
            view += ["--bind", tmp, "/tmp"]
        else:
            view += ["--size", str(TMPFS_BYTES), "--perms", "1777", "--tmpfs", "/tmp"]
        covers = ["/tmp"]
        rebound = [*self.readonly, *readonly]
        hide = list(self.hidden)
        if self.privileged:
            # The sandbox uid could not pass through a directory others may not
            # enter (a 0700 home above the agent's state): hide it too, so that what
            # is bound back below it sits under passable mount points.
            hide += [closed for path in (*rebound, *visible)
                     if (closed := _closed_ancestor(path)) is not None]
        for path in dict.fromkeys(hide):
            # Under /tmp or another hidden directory it is hidden already; one that
            # does not exist has nothing to hide (and no mount point to use).
            covered = any(under(path, c) and path != c for c in ("/tmp", *hide))
            if not covered and os.path.isdir(path):
                view += ["--perms", "0755", "--tmpfs", path]
                covers.append(path)
            elif not covered and os.path.isfile(path) and self.empty_file:
                view += ["--ro-bind", self.empty_file, path]  # a secret file: an empty one
        # bubblewrap makes missing mount points 0700 (root's, then nobody's inside):
        # the sandbox uid could not pass through them, so make them 0755 first.
        parents = dict.fromkeys(parent for path in (*rebound, *visible)
                                for parent in _parents_inside(path, covers))
        for parent in parents:
            view += ["--perms", "0755", "--dir", parent]
        for path in rebound:
            view += ["--ro-bind", path, path]
        for path in visible:
            view += ["--bind", path, path]
        made = [*covers, *(inside for _, inside in moved)]
        for host, inside in moved:
            for parent in _parents_inside(inside, made):
                if parent not in made:
                    view += ["--perms", "0755", "--dir", parent]
                    made.append(parent)
            view += ["--bind", host, inside]
        return view

    def _namespaces(self, own_network: bool = True) -> list[str]:
        flags = ["--unshare-user", "--uid", str(INNER_ID), "--gid", str(INNER_ID),
                 "--disable-userns", "--unshare-pid", "--unshare-ipc",
                 *(["--unshare-net"] if own_network else []),
                 "--unshare-uts", "--hostname", "nbfleet", "--unshare-cgroup-try",
                 # In its PID namespace the kernel's parent is bubblewrap's init (pid
                 # 1), which ipykernel's parent poller takes for "my parent died".
                 # Parent 1 tells ipykernel not to poll (and not to print its console
                 # notes); --die-with-parent ties the sandbox to the agent instead.
                 "--setenv", "JPY_PARENT_PID", "1"]
        if self.seccomp is not None:
            flags += ["--seccomp", str(SECCOMP_FD)]
        return flags

    @staticmethod
    def _devices(devices: list[str], inner: bool = False) -> list[str]:
        """Each device node (or directory of them) at ``/dev/<its name>``, whichever
        directory the host keeps it in (``devices.DEVICE_DIR_ENV``). Visible is not
        usable: which GPUs a kernel may open is its slot's device cgroup's to say."""
        binds = []
        for device in devices:
            target = f"/dev/{os.path.basename(device)}"
            binds += ["--dev-bind", target if inner else device, target]
        return binds

    @staticmethod
    def _tail(workdir: str) -> list[str]:
        return ["--die-with-parent", "--chdir", workdir, "--"]


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory above ``path`` that others may not pass through."""
    parts = path.strip("/").split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:depth])
        try:
            if not os.stat(ancestor).st_mode & 0o001:
                return ancestor
        except OSError:
            return None
    return None


def _parents_inside(path: str, covers: list[str]) -> tuple[str, ...]:
    """The directories between ``path`` and the hidden (tmpfs) directory it sits
    in, outermost first: the mount points bubblewrap would have to make."""
    cover = max((c for c in covers if under(path, c) and path != c), key=len, default=None)
    if cover is None:
        return ()
    parents = []
    current = os.path.dirname(path)
    while under(current, cover) and current != cover:
        parents.append(current)
        current = os.path.dirname(current)
    return tuple(reversed(parents))


def under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def unseen(sandbox: Sandbox, paths: list[str]) -> list[str]:
    """Those of ``paths`` (resolved) the sandbox would hide: under ``/tmp`` or a hidden
    directory, and not already bound back."""
    found = []
    for path in map(os.path.realpath, paths):
        covered = any(under(path, c) for c in ("/tmp", *sandbox.hidden))
        if covered and not any(under(path, r) for r in sandbox.readonly):
            found.append(path)
    return list(dict.fromkeys(found))
