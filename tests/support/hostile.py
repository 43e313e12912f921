"""A platform under attack: two tenants' kernels on a live cluster, and the probes a
hostile notebook runs from inside its kernel.

Each probe is the source of a cell. It tries an attack, never stops at the first
refusal, and prints one JSON line saying what got through, so a test asserts on
the whole attack surface at once and its failure message names each hole.
Every probe is bounded (a count and a time), so even with a protection removed
the machine running the tests stays safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, create_running, run_cell, start_kernel

#: For tests of the sandbox itself: skipped where bubblewrap is missing.
NEEDS_BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (.ci/run installs it)")

#: Limits the hostile cluster runs with: small, so the bombs hit them quickly.
MEMORY_LIMIT = "384MiB"
CPU_LIMIT = "1"
PIDS_LIMIT = 128
DISK_LIMIT_MIB = 64
LIMIT_ARGS = ("--kernel-memory", MEMORY_LIMIT, "--kernel-cpus", CPU_LIMIT,
              "--kernel-pids", str(PIDS_LIMIT), "--workspace-disk", f"{DISK_LIMIT_MIB}MiB")


@dataclass
class Tenant:
    client: httpx.Client
    workspace_id: str
    kernel_id: str

    def run(self, cluster: Cluster, code: str, timeout: float = 120.0) -> dict[str, Any]:
        """Run a probe; its last stdout line that is a JSON object is its verdict."""
        result = run_cell(cluster, self.client, self.workspace_id, self.kernel_id, code)
        assert result.status == "ok", (result.reply, result.outputs)
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        assert lines, result.outputs
        verdict: dict[str, Any] = json.loads(lines[-1])
        return verdict


@dataclass
class Battlefield:
    """The live platform, the attacker, the victim, and what the attacker wants."""

    mode: str  # "root" or "unprivileged"
    cluster: Cluster
    attacker: Tenant
    victim: Tenant
    #: Host pids the attacker must not reach: the control plane, the agent, the
    #: victim's kernel.
    host_pids: dict[str, int] = field(default_factory=dict)
    #: Host paths the attacker must not read, by any route.
    secrets: dict[str, str] = field(default_factory=dict)
    agent_port: int = 0
    isolation: dict[str, Any] = field(default_factory=dict)
    #: A host directory the agent could write (it is the agent's user's) but the
    #: kernel cannot see: the target of the links a kernel plants for the agent.
    outside: Path = Path("/nonexistent")


# ----------------------------------------------------------------- running as
def unprivileged_user() -> tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def platform_user(mode: str) -> tuple[int, int] | None:
    """Who the platform runs as in ``mode`` ("root" or "unprivileged"): None for
    the test's own user; skips (fails under CI) what this test run cannot do."""
    if os.geteuid() != 0:
        if mode == "root":
            pytest.skip("the tests run unprivileged: the platform cannot run as root")
        return None  # the platform runs as we do
    if mode == "root":
        return None
    user = unprivileged_user()
    why = interpreter_reachable_by(*user)
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return user


def interpreter_reachable_by(uid: int, gid: int) -> str | None:
    """None if ``uid`` can run this interpreter and import nbfleet; else why not."""
    probe = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable,
         "-c", "import nbfleet.cli.main"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        return None
    return (f"uid {uid} cannot run {sys.executable} (an ancestor directory is not "
            f"traversable, e.g. /root is 0700: `chmod o+x /root`, as .ci/run does): "
            f"{probe.stderr.strip()[-300:]}")


@contextlib.contextmanager
def delegated_cgroups(uid: int, gid: int, name: str) -> Iterator[str | None]:
    """A cgroup subtree that ``uid`` may manage (as systemd's Delegate= gives one),
    so an unprivileged agent can set its kernels' limits; None where the
    hierarchy is not v1 with the three controllers."""
    made = []
    for controller in ("memory", "cpu", "pids"):
        root = Path("/sys/fs/cgroup") / controller
        if not (root / "cgroup.procs").exists():
            break
        path = root / name
        path.mkdir(exist_ok=True)
        for entry in (path, path / "cgroup.procs", path / "tasks"):
            os.chown(entry, uid, gid)
        made.append(path)
    try:
        yield f"/{name}" if len(made) == 3 else None
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                for child in sorted(path.rglob("*"), key=lambda p: len(str(p)), reverse=True):
                    if child.is_dir():
                        child.rmdir()
                path.rmdir()


# --------------------------------------------------------------- host facts
def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (the agent's kernels)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kernel_host_pids(agent_pid: int) -> list[int]:
    """Host pids of the ipykernel processes the agent runs."""
    pids = []
    for pid in descendants(agent_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith((b"python", b"python3", b"python3.11")) and any(
                b"ipykernel" in part for part in argv):
            pids.append(pid)
    return pids


def host_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("Uid:"):
                return int(line.split()[2])  # the effective uid
    raise LookupError(pid)


def new_tenant(cluster: Cluster, org: str) -> Tenant:
    client = cluster.new_user(org=org, project="p")
    workspace_id = create_running(client, name=org)
    return Tenant(client, workspace_id, start_kernel(client, workspace_id))


# ------------------------------------------------------------------ probes
PROLOGUE = "import json, os, sys, errno, socket, signal, time\n"

IDENTITY = PROLOGUE + r"""
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(json.dumps({k: status[k].strip() for k in ("Uid", "CapEff", "CapPrm", "CapBnd",
                                                 "CapAmb", "NoNewPrivs", "Seccomp")}))
"""


def read_probe(paths: list[str], pids: list[int]) -> str:
    """Try every route to each secret: the path itself, and through every host pid's
    /proc root and cwd; then every host pid's environ and cmdline."""
    return PROLOGUE + f"""
paths, pids, got = {paths!r}, {pids!r}, {{}}
routes = list(paths)
for pid in pids:
    routes += [f"/proc/{{pid}}/root{{p}}" for p in paths]
    routes += [f"/proc/{{pid}}/cwd", f"/proc/{{pid}}/environ", f"/proc/{{pid}}/cmdline",
               f"/proc/{{pid}}/root/etc/shadow"]
for route in routes:
    try:
        if os.path.isdir(route):
            got[route] = sorted(os.listdir(route))[:5]
        else:
            with open(route, "rb") as handle:
                got[route] = handle.read(64).decode("latin-1")
    except OSError:
        pass
visible = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps({{"read": got, "visible_pids": visible}}))
"""


def signal_probe(pids: list[int]) -> str:
    """SIGSTOP then SIGKILL every host pid it knows; the host checks who survived."""
    return PROLOGUE + f"""
hits = {{}}
for pid in {pids!r}:
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(pid, sig)
            hits[pid] = hits.get(pid, []) + [int(sig)]
        except OSError as exc:
            pass
print(json.dumps({{"delivered": hits}}))
"""


def network_probe(targets: list[tuple[str, int]], unix_sockets: Sequence[str] = ()) -> str:
    """Connect to each (host, port) and Unix socket; report what answered, the
    routing table (every route's device, and the default routes'), the network
    devices and the resolver."""
    return PROLOGUE + f"""
reached = []
for host, port in {targets!r}:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect((host, port))
            reached.append(f"{{host}}:{{port}}")
        except OSError:
            pass
for path in {list(unix_sockets)!r}:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(path)
            reached.append(path)
        except OSError:
            pass
table = [line.split() for line in open("/proc/net/route").read().splitlines()[1:]]
routes6 = [line.split()[-1] for line in open("/proc/net/ipv6_route").read().splitlines()
           if line.split()[-1] != "lo"]
devices = [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]]
print(json.dumps({{"reached": reached, "routes": [r[0] for r in table] + routes6,
                  "default_routes": [r[0] for r in table if r[1] == "00000000"],
                  "devices": devices, "resolv": open("/etc/resolv.conf").read()}}))
"""


SYSCALLS = PROLOGUE + r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(result):
    return 0 if result == 0 else ctypes.get_errno()
libc.syscall.restype = ctypes.c_long
outcomes = {
    "mount": errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "unshare(CLONE_NEWUSER)": errno_of(libc.unshare(0x10000000)),
    "unshare(CLONE_NEWNS)": errno_of(libc.unshare(0x00020000)),
    "keyctl": errno_of(libc.syscall(250, 0, 0, 0, 0, 0)),
    "bpf": errno_of(libc.syscall(321, 0, 0, 0)),
    "ptrace(PTRACE_TRACEME)": errno_of(libc.ptrace(0, 0, None, None)),
    "setns": errno_of(libc.setns(0, 0)),
    "kexec_load": errno_of(libc.syscall(246, 0, 0, 0, 0)),
    "chroot": errno_of(libc.chroot(b"/")),
}
print(json.dumps(outcomes))
"""


def fork_bomb(attempts: int) -> str:
    """Fork up to ``attempts`` sleeping children, count how many the kernel got,
    then kill them all."""
    return PROLOGUE + f"""
children, refusal = [], None
for _ in range({attempts}):
    try:
        pid = os.fork()
    except OSError as exc:
        refusal = errno.errorcode.get(exc.errno, str(exc.errno))
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
print(json.dumps({{"forked": len(children), "refusal": refusal}}))
"""


def disk_bomb(directory: str, cap_mib: int) -> str:
    """Write 1 MiB at a time into ``directory`` until refused or ``cap_mib``."""
    return PROLOGUE + f"""
path, written, refusal = os.path.join({directory!r}, "bomb.bin"), 0, None
block = b"x" * (1 << 20)
try:
    with open(path, "wb") as handle:
        while written < {cap_mib}:
            handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
            written += 1
except OSError as exc:
    refusal = errno.errorcode.get(exc.errno, str(exc.errno))
finally:
    if os.path.exists(path):
        os.unlink(path)
print(json.dumps({{"written_mib": written, "refusal": refusal}}))
"""


def memory_bomb(cap_mib: int) -> str:
    """Allocate and touch 32 MiB at a time up to ``cap_mib``; at the limit the
    kernel is killed and this cell never answers."""
    return PROLOGUE + f"""
hoard = []
for _ in range({cap_mib} // 32):
    hoard.append(bytearray(32 << 20))
    hoard[-1][::4096] = b"x" * len(hoard[-1][::4096])
print(json.dumps({{"allocated_mib": 32 * len(hoard)}}))
"""


def cpu_hog(processes: int, seconds: float) -> str:
    """``processes`` busy loops for ``seconds`` of wall time; reports how much CPU
    time they got in all (a 1-CPU limit caps it near ``seconds``)."""
    return PROLOGUE + f"""
start = time.monotonic()
children = []
for _ in range({processes}):
    pid = os.fork()
    if pid == 0:
        os.setsid()  # a session each: the scheduler's autogroups would share them out
        while time.monotonic() - start < {seconds}:
            pass
        os._exit(0)
    children.append(pid)
cpu = 0.0
for pid in children:
    _, _, usage = os.wait4(pid, 0)
    cpu += usage.ru_utime + usage.ru_stime
print(json.dumps({{"cpu_s": cpu, "wall_s": time.monotonic() - start}}))
"""


#: Rearrange what the agent will bind into the next start of this kernel: the
#: directories bound into it (its working directory, its state, its package layer,
#: its /tmp: each a mount point), its connection file (a symlink to a host file
#: the agent would then chown), a file beside it.
TAMPER = PROLOGUE + r"""
import sys
home = os.environ["HOME"]
connection = sys.argv[sys.argv.index("-f") + 1]
bound = {"working directory": os.getcwd(), "/tmp": "/tmp",
         "state": os.path.dirname(os.environ["NBFLEET_STATE_DIR"]),
         "package layer": os.environ["PIP_TARGET"]}
attempts = {f"rename the {name}": (lambda path=path: os.rename(path, home + "/moved"))
            for name, path in bound.items()}
attempts |= {
    "replace connection file": lambda: os.unlink(connection),
    "file beside connection file": lambda: open(connection + ".x", "w").close(),
}
done = []
for name, attempt in attempts.items():
    try:
        attempt()
        done.append(name)
    except OSError:
        pass
print(json.dumps({"done": done}))
"""

#: Devices a program expects, and output written past ipykernel to the process's
#: own stdout and stderr.
DEVICES_AND_RAW_OUTPUT = PROLOGUE + r"""
import subprocess
with open("/dev/null", "w") as sink:
    sink.write("x")
random_bytes = len(open("/dev/urandom", "rb").read(16))
status = subprocess.run(["true"], stdout=subprocess.DEVNULL).returncode
os.write(1, b"RAW-STDOUT-MARKER\n")
os.write(2, b"RAW-STDERR-MARKER\n")
time.sleep(0.5)  # ipykernel relays fd output from a thread: let it pass before the verdict
print(json.dumps({"random": random_bytes, "status": status}))
"""
