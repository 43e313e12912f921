"""Everything the agent isolates user code with, chosen once at start-up.

``open_isolation`` tries each protection on this host and keeps what works: the
bubblewrap sandbox, the syscall filter, per-slot uids, cgroups and disk quotas.
``report`` says which are active and why the others are missing; the agent logs
it, registers it with the control plane, and ``nbfleet up`` prints it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from nbfleet.agent.sandbox.cgroups import CgroupsUnavailable, CgroupTree
from nbfleet.agent.sandbox.command import Sandbox, under
from nbfleet.agent.sandbox.devices import gpu_nodes
from nbfleet.agent.sandbox.egress import Egress, EgressUnavailable
from nbfleet.agent.sandbox.gpus import HostGpus
from nbfleet.agent.sandbox.identity import Identities
from nbfleet.agent.sandbox.quota import DiskQuotas, QuotasUnavailable
from nbfleet.agent.sandbox.seccomp import SeccompUnavailable, write_filter
from nbfleet.model.limits import Limits, format_size

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "none")


class SandboxUnavailable(RuntimeError):
    """``--sandbox bwrap`` was asked for but bubblewrap cannot run here."""


@dataclass
class Isolation:
    sandbox: Sandbox | None
    limits: Limits = field(default_factory=Limits)
    identities: Identities | None = None
    cgroups: CgroupTree | None = None
    quotas: DiskQuotas | None = None
    #: Internet access for projects in egress mode (root agents only).
    egress: Egress | None = None
    #: This host's GPU nodes and which slot each is open to (None: no GPU nodes).
    gpus: HostGpus | None = None
    #: protection -> (active, what it does or why it is missing)
    report: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def report_json(self) -> dict[str, Any]:
        return {name: {"active": active, "detail": detail}
                for name, (active, detail) in self.report.items()}

    def close(self) -> None:
        if self.cgroups is not None:
            self.cgroups.close()


def python_paths() -> list[str]:
    """What a kernel needs to start: the interpreter, its environment, and nbfleet's
    source (an editable install points there)."""
    import nbfleet

    paths = [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.path.dirname(os.path.realpath(nbfleet.__file__)))]
    return [os.path.realpath(p) for p in paths]


def hidden_everywhere() -> list[str]:
    """Directories with other people's or services' secrets on a typical host: home
    directories, and /run with its Unix sockets (PostgreSQL's, Docker's), which a
    network namespace does not cover."""
    found = ["/root", "/home", "/run", os.path.expanduser("~")]
    return [os.path.realpath(p) for p in found if os.path.isdir(p) and p != "/"]


def _works(sandbox: Sandbox, identities: Identities | None) -> str | None:
    """None if a trivial command runs in the sandbox here, else why not."""
    identity = identities.allocate() if identities else None
    try:
        argv = sandbox.wrap(["true"], [], "/", identity=identity)
        probe = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        if identities and identity:
            identities.release(identity)
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"exit {probe.returncode}")


def open_isolation(mode: str, hidden: list[str], state_dir: str, local_id: str,
                   limits: Limits | None = None, cgroup_parent: str | None = None) -> Isolation:
    """The strongest isolation this host allows; ``mode`` says whether a missing
    bubblewrap is an error (``bwrap``), a loud warning (``auto``) or wanted (``none``).
    ``local_id`` names the machine-wide resources (cgroup, network namespaces): unique
    to this agent on this machine (``service.local_id``)."""
    if mode not in MODES:
        raise ValueError(f"sandbox must be one of {', '.join(MODES)}, not {mode!r}")
    isolation = Isolation(None, limits or Limits())
    report = isolation.report
    if mode == "none":
        report["sandbox"] = (False, "turned off (--sandbox none): kernels are plain processes")
        return isolation
    sandbox, why = _make_sandbox(hidden, state_dir, report)
    if sandbox is None:
        if mode == "bwrap":
            raise SandboxUnavailable(f"bubblewrap cannot create a sandbox here: {why} "
                                     "(install the 'bubblewrap' package, or pass --sandbox none)")
        log.warning("bubblewrap is unavailable (%s): kernels run WITHOUT a sandbox and can "
                    "read this host's files; install 'bubblewrap' for isolation", why)
        report["sandbox"] = (False, f"bubblewrap unavailable: {why}")
        return isolation
    isolation.sandbox = sandbox
    isolation.identities = Identities() if sandbox.privileged else None
    _open_limits(isolation, state_dir, local_id, cgroup_parent)
    _open_gpus(isolation)
    try:
        isolation.egress = Egress.open(state_dir, local_id)
        isolation.sandbox = replace(sandbox, resolv_conf=isolation.egress.resolv_conf)
        report["egress"] = (True, "projects in egress mode reach the public internet "
                                  "(slirp4netns; private ranges, link-local and the host "
                                  "refused)")
    except (EgressUnavailable, OSError) as exc:
        report["egress"] = (False, f"projects in egress mode get no network: {exc}")
    return isolation


def _make_sandbox(hidden: list[str], state_dir: str,
                  report: dict[str, tuple[bool, str]]) -> tuple[Sandbox | None, str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bwrap is not installed"
    privileged = os.geteuid() == 0
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    if privileged and not os.path.exists(setpriv):
        return None, "setpriv (util-linux) is not installed"
    covered = ["/tmp", *hidden, *hidden_everywhere()]
    hide = tuple(dict.fromkeys(os.path.realpath(p) for p in (*hidden, *hidden_everywhere())))
    readonly = tuple(dict.fromkeys(p for p in python_paths() if any(under(p, c)
                                                                     for c in covered)))
    seccomp: str | None = os.path.join(state_dir, "seccomp.bpf")
    try:
        os.makedirs(state_dir, exist_ok=True)
        blocked = write_filter(str(seccomp))
        report["seccomp"] = (True, f"{len(blocked)} syscalls refused (Docker's default "
                                   "profile's refusals: mount, keyctl, bpf, ptrace, ...)")
    except (SeccompUnavailable, OSError) as exc:
        seccomp = None
        report["seccomp"] = (False, str(exc))
    empty = os.path.join(state_dir, "empty")
    if not os.path.exists(empty):
        with open(empty, "w"):
            pass
        os.chmod(empty, 0o444)
    sandbox = Sandbox(bwrap, hide, readonly, privileged=privileged, seccomp=seccomp,
                      setpriv=setpriv, empty_file=empty)
    identities = Identities() if privileged else None
    why = _works(sandbox, identities)
    if why is not None:
        return None, why
    report["sandbox"] = (True, "user, PID, mount, network, IPC and UTS namespaces; no "
                               "capabilities; no_new_privs; host read-only, secrets hidden")
    report["uid"] = ((True, "each slot runs as its own unprivileged host uid") if privileged
                     else (False, "the agent is not root: kernels map to the agent's own uid "
                                  "outside their user namespace"))
    report["network"] = (True, "own network namespace: no host loopback, no private ranges, "
                               "no metadata service, no internet")
    return sandbox, ""


def _open_limits(isolation: Isolation, state_dir: str, local_id: str,
                 cgroup_parent: str | None) -> None:
    report = isolation.report
    try:
        isolation.cgroups = CgroupTree.open(local_id, cgroup_parent)
        limits = isolation.limits.describe().rsplit(", disk", 1)[0]
        report["cgroups"] = (True, f"cgroup v{isolation.cgroups.version}: {limits} "
                                   "per workspace")
    except (CgroupsUnavailable, OSError) as exc:
        report["cgroups"] = (False, f"no memory, CPU or process limits: {exc}")
    if isolation.limits.disk_bytes is None:
        report["disk"] = (False, "no disk limit configured (--workspace-disk)")
        return
    try:
        isolation.quotas = DiskQuotas.open(os.path.join(state_dir, "disks"))
        report["disk"] = (True, f"{format_size(isolation.limits.disk_bytes)} per workspace, "
                                "its own preallocated filesystem: a full quota fails with "
                                "ENOSPC in the cell only")
    except (QuotasUnavailable, OSError) as exc:
        report["disk"] = (False, f"no disk quota: {exc}")


def _open_gpus(isolation: Isolation) -> None:
    """GPU nodes are bound into GPU slots; a device cgroup decides which of them a
    slot may open (``gpus.py``). Without one, that is only CUDA_VISIBLE_DEVICES."""
    nodes = gpu_nodes()
    if not nodes:
        return
    isolation.gpus = HostGpus(nodes)
    count = len(isolation.gpus.gpus)
    if isolation.cgroups is not None and isolation.cgroups.devices is not None:
        isolation.report["gpus"] = (True, f"{count} GPU nodes: a slot opens only the GPUs "
                                          "bound to it now (device cgroup), and a GPU still "
                                          "held open stays committed to its slot")
    else:
        isolation.report["gpus"] = (False, f"{count} GPU nodes, no device cgroup (cgroup v2 "
                                           "or not root): a GPU slot's kernels can open "
                                           "every GPU of this host")
