"""Isolation with bubblewrap: each kernel sees only its own workspace, each job
only its own work directory.

Inside the sandbox the root filesystem is read-only, ``/tmp`` is private, and the
agent's state (every workspace's runtime), the control plane's home (its DB and
secrets) and the IPC sockets of other kernels are hidden under empty tmpfs mounts;
only the kernel's own runtime directory and socket directory are bound back.
Without bubblewrap (``--sandbox none``, or ``auto`` where it is missing) kernels
run as plain processes, and the agent says so loudly at start-up.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "none")


class SandboxUnavailable(RuntimeError):
    """``--sandbox bwrap`` was asked for but bubblewrap cannot run here."""


@dataclass(frozen=True, slots=True)
class Sandbox:
    bwrap: str
    hidden: tuple[str, ...]
    #: Read-only paths bound back over hidden ones: the Python environment, when it
    #: happens to live under /tmp or another hidden directory.
    readonly: tuple[str, ...] = ()

    def wrap(self, argv: list[str], visible: list[str], workdir: str,
             devices: list[str] | None = None, job: bool = False,
             readonly: list[str] | None = None) -> list[str]:
        """``argv`` inside the sandbox; ``devices`` are device nodes to pass through
        (a job's GPUs: ``/dev/nvidia*``), ``readonly`` more paths bound back
        read-only (a job's binary, when it lives under a hidden path). Under bwrap
        a child killed by signal N ends bwrap with exit status 128 + N, as a shell
        reports it."""
        command = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                   "--tmpfs", "/tmp"]
        for device in devices or ():
            command += ["--dev-bind", device, device]
        for path in self.hidden:
            command += ["--tmpfs", path]
        for path in (*self.readonly, *(readonly or ())):
            command += ["--ro-bind", path, path]
        for path in visible:
            command += ["--bind", path, path]
        command += ["--die-with-parent", "--chdir", workdir, "--"]
        if not job:
            # Interrupts are sent to the kernel's process group, which bwrap shares.
            # bwrap must ignore SIGINT (ignoring survives exec), or an interrupt would
            # kill it and, through --die-with-parent, the kernel; ipykernel sets its
            # own SIGINT handler.
            return ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "nbfleet-sandbox", *command,
                    *argv]
        # A job is stopped with SIGTERM to its process group, then SIGKILL after a
        # grace period. bwrap ignores both INT and TERM so the binary gets its grace;
        # `env --default-signal` gives the binary the default handlers back.
        return ["/bin/sh", "-c", 'trap "" INT TERM; exec "$@"', "nbfleet-sandbox", *command,
                "env", "--default-signal=INT,TERM", *argv]


def unseen(sandbox: Sandbox, paths: list[str]) -> list[str]:
    """Those of ``paths`` (resolved) the sandbox would hide: under ``/tmp`` or a hidden
    directory, and not already bound back."""
    found = []
    for path in map(os.path.realpath, paths):
        covered = any(_under(path, c) for c in ("/tmp", *sandbox.hidden))
        if covered and not any(_under(path, r) for r in sandbox.readonly):
            found.append(path)
    return list(dict.fromkeys(found))


def gpu_devices() -> list[str]:
    """NVIDIA's device nodes on this host (none on a machine without GPUs)."""
    return sorted(glob.glob("/dev/nvidia*"))


def python_paths() -> list[str]:
    """What a kernel needs to start: the interpreter, its environment, and nbfleet's
    source (an editable install points there)."""
    import nbfleet

    paths = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.path.dirname(os.path.realpath(nbfleet.__file__)))]
    return [os.path.realpath(p) for p in paths]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _works(bwrap: str) -> bool:
    try:
        probe = subprocess.run([bwrap, "--ro-bind", "/", "/", "--tmpfs", "/tmp", "true"],
                               capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def make_sandbox(mode: str, hidden: list[str]) -> Sandbox | None:
    if mode not in MODES:
        raise ValueError(f"sandbox must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "none":
        return None
    bwrap = shutil.which("bwrap")
    if bwrap is not None and _works(bwrap):
        covered = ["/tmp", *hidden]
        readonly = [p for p in python_paths() if any(_under(p, c) for c in covered)]
        return Sandbox(bwrap, tuple(dict.fromkeys(hidden)), tuple(dict.fromkeys(readonly)))
    if mode == "bwrap":
        raise SandboxUnavailable(
            "bubblewrap is not installed or cannot create namespaces here "
            "(install the 'bubblewrap' package, or pass --sandbox none)"
        )
    log.warning("bubblewrap is unavailable: kernels run WITHOUT a sandbox and can read "
                "this host's files; install 'bubblewrap' for isolation")
    return None
