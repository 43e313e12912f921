"""Sandbox command construction, mode selection, and the pieces it is made of.

The hostile-user suite (tests/security) attacks the sandbox from inside real
kernels; these tests pin down how the command is built and what each piece does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from nbfleet.agent.sandbox import Sandbox, SandboxUnavailable, open_isolation, unseen
from nbfleet.agent.sandbox import isolation as isolation_module
from nbfleet.agent.sandbox.cgroups import Cgroup
from nbfleet.agent.sandbox.command import SECCOMP_FD, _parents_inside
from nbfleet.agent.sandbox.identity import Identities, Identity
from nbfleet.agent.sandbox.seccomp import write_filter
from nbfleet.agent.slots import Slot, new_kernel

HAVE_BWRAP = shutil.which("bwrap") is not None


def _flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, part in enumerate(argv) if part == flag]


def test_an_unprivileged_agent_runs_one_bubblewrap_with_every_namespace() -> None:
    agent = "/usr/share"  # any directory that exists outside /tmp
    sandbox = Sandbox("/usr/bin/bwrap", (str(agent), "/nonexistent/home"),
                      seccomp="/srv/f.bpf")
    argv = sandbox.wrap(["python", "-m", "ipykernel_launcher"], [f"{agent}/rt/ws_1"],
                        f"{agent}/rt/ws_1/files")
    assert argv[:2] == ["/bin/sh", "-c"]
    launcher = argv[2]
    assert f"exec {SECCOMP_FD}</srv/f.bpf" in launcher and 'trap "" INT;' in launcher
    inner = argv[4:]
    assert inner.count("/usr/bin/bwrap") == 1 and "/usr/bin/setpriv" not in inner
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                 "--unshare-uts", "--disable-userns", "--die-with-parent"):
        assert flag in inner, flag
    assert _flags(inner, "--seccomp") == [str(SECCOMP_FD)]
    # Hidden directories are covered before the kernel's own directory is bound back;
    # one that does not exist yet has nothing to hide.
    hide, bind = inner.index(agent), inner.index("--bind")
    assert inner[hide - 1] == "--tmpfs" and hide < bind
    assert "/nonexistent/home" not in inner
    assert inner[-4:] == ["--", "python", "-m", "ipykernel_launcher"]


def test_a_root_agent_drops_to_the_slots_uid_between_two_bubblewraps() -> None:
    sandbox = Sandbox("/usr/bin/bwrap", ("/srv/agent",), privileged=True)
    cgroup = Cgroup(1, ("/sys/fs/cgroup/memory/x/s1", "/sys/fs/cgroup/cpu/x/s1",
                        "/sys/fs/cgroup/pids/x/s1"))
    argv = sandbox.wrap(["python"], ["/srv/agent/rt/s1"], "/srv/agent/rt/s1/files",
                        identity=Identity(2000000, 2000000), cgroup=cgroup,
                        tmp="/srv/agent/rt/s1/tmp")
    launcher = argv[2]
    for procs in cgroup.procs_files:  # joined before bubblewrap starts
        assert f"echo $$ > {procs}" in launcher
    first, second = [i for i, part in enumerate(argv) if part == "/usr/bin/bwrap"]
    setpriv = argv.index("/usr/bin/setpriv")
    assert first < setpriv < second
    drop = argv[setpriv:second]
    assert "--reuid=2000000" in drop and "--regid=2000000" in drop
    assert {"--clear-groups", "--no-new-privs", "--inh-caps=-all",
            "--bounding-set=-all"} <= set(drop)
    # Namespaces are made by the unprivileged, inner bubblewrap.
    assert "--unshare-user" in argv[second:] and "--unshare-user" not in argv[first:setpriv]
    assert _flags(argv[first:setpriv], "--bind")[-2:] == ["/srv/agent/rt/s1/tmp",
                                                           "/srv/agent/rt/s1"]


def test_an_egress_sandbox_enters_its_namespace_instead_of_making_one() -> None:
    sandbox = Sandbox("/usr/bin/bwrap", (), privileged=True, resolv_conf="/srv/resolv.conf")
    argv = sandbox.wrap(["python"], [], "/w", netns="/run/netns/nbf-ws_1")
    enter = argv.index("nsenter")
    assert argv[enter:enter + 3] == ["nsenter", "--net=/run/netns/nbf-ws_1", "--"]
    assert enter < argv.index("/usr/bin/bwrap")  # entered as root, before any bwrap
    assert "--unshare-net" not in argv
    bind = argv.index("/etc/resolv.conf")
    assert argv[bind - 2:bind] == ["--ro-bind", "/srv/resolv.conf"]
    assert "--unshare-net" in sandbox.wrap(["python"], [], "/w")  # everyone else: none


def test_mount_points_inside_hidden_directories_are_made_passable() -> None:
    covers = ["/tmp", "/root"]
    assert _parents_inside("/root/.pyenv/versions/3.11", covers) == (
        "/root/.pyenv", "/root/.pyenv/versions")
    assert _parents_inside("/usr/lib", covers) == ()
    home = "/usr/share"  # exists outside /tmp
    sandbox = Sandbox("/usr/bin/bwrap", (home,), (f"{home}/.pyenv/v",))
    argv = sandbox.wrap(["python"], [], "/w")
    made = argv.index(f"{home}/.pyenv")
    assert argv[made - 3:made] == ["--perms", "0755", "--dir"]
    assert made < argv.index("--ro-bind", argv.index("--ro-bind") + 1)


def test_modes() -> None:
    assert open_isolation("none", ["/x"], "/tmp/unused", "host_t").sandbox is None
    with pytest.raises(ValueError, match="sandbox must be one of"):
        open_isolation("docker", [], "/tmp/unused", "host_t")


def test_bwrap_mode_fails_clearly_without_bubblewrap(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(SandboxUnavailable, match="install the 'bubblewrap' package"):
        open_isolation("bwrap", [], str(tmp_path), "host_t")
    degraded = open_isolation("auto", [], str(tmp_path), "host_t")  # with a warning
    assert degraded.sandbox is None
    assert degraded.report["sandbox"][0] is False


def test_a_python_environment_under_a_hidden_path_stays_visible(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A checkout under /tmp (as in CI) keeps its venv inside the sandbox, read-only."""
    monkeypatch.setattr(isolation_module, "_works", lambda _sandbox, _ids: None)
    monkeypatch.setattr(isolation_module, "python_paths",
                        lambda: ["/tmp/clone/.venv", "/usr", "/srv/agent/venv"])
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    isolation = open_isolation("auto", ["/srv/agent"], str(tmp_path), f"host_t{os.getpid()}")
    isolation.close()
    sandbox = isolation.sandbox
    assert sandbox is not None
    assert sandbox.readonly == ("/tmp/clone/.venv", "/srv/agent/venv")


def test_only_files_the_sandbox_would_hide_are_bound_back(tmp_path: Path) -> None:
    hidden = tmp_path / "state"
    venv = tmp_path / "venv"
    sandbox = Sandbox("/usr/bin/bwrap", (str(hidden),), (str(venv),))
    paths = ["/usr/bin/env", "/tmp/tool/gen", str(hidden / "bin" / "x"), str(venv / "python"),
             "/tmp/tool/gen"]
    assert unseen(sandbox, paths) == [os.path.realpath("/tmp/tool/gen"),
                                      os.path.realpath(hidden / "bin" / "x")]


def test_sandbox_uids_are_unprivileged_and_never_shared() -> None:
    identities = Identities()
    taken = [identities.allocate() for _ in range(200)]
    assert len({i.uid for i in taken}) == 200
    assert all(i.uid >= 1 << 20 and i.uid != os.getuid() for i in taken)
    identities.release(taken[0])
    assert taken[0].uid not in identities.in_use


def test_the_seccomp_filter_compiles_and_names_what_it_refuses(tmp_path: Path) -> None:
    path = tmp_path / "filter.bpf"
    refused = write_filter(str(path))
    assert {"mount", "keyctl", "bpf", "ptrace", "kexec_load", "unshare", "setns"} <= set(refused)
    assert path.stat().st_size > 0 and path.stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
def test_bwrap_mode_really_hides_paths(tmp_path: Path) -> None:
    hidden, visible = tmp_path / "hidden", tmp_path / "hidden" / "mine"
    visible.mkdir(parents=True)
    (hidden / "secret").write_text("s")
    isolation = open_isolation("bwrap", [str(hidden)], str(tmp_path / "state"),
                               f"host_t{os.getpid()}")
    isolation.close()  # its cgroups are not used here
    assert isolation.sandbox is not None
    identity = isolation.identities.allocate() if isolation.identities else None
    if identity is not None:
        os.chown(visible, identity.uid, identity.gid)
    argv = isolation.sandbox.wrap(["/bin/sh", "-c", "ls -A ..; touch ok; id -u"],
                                  [str(visible)], str(visible), identity=identity)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:-1] == ["mine"]  # the secret is not there
    assert result.stdout.split()[-1] == "1000"  # the sandbox's own uid, inside
    assert (visible / "ok").exists()
    if identity is not None:  # outside, the file belongs to the slot's uid, not root
        assert (visible / "ok").stat().st_uid == identity.uid


def test_a_root_agent_hides_directories_the_sandbox_uid_could_not_enter() -> None:
    """A 0700 home above the agent's state would stop the sandbox uid on its way to
    its slot: it is covered by a passable tmpfs, and the slot bound back under it.
    (Outside /tmp, which the sandbox replaces anyway.)"""
    from nbfleet.agent.sandbox.command import _closed_ancestor

    top = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        top.chmod(0o755)
        home = top / "home"
        slot = home / "agent" / "runtimes" / "ws_1"
        slot.mkdir(parents=True)
        home.chmod(0o700)
        closed = _closed_ancestor(str(slot))
        assert closed == str(home)
        _check_covered(closed, str(slot))
    finally:
        shutil.rmtree(top)


def _check_covered(closed: str, slot: str) -> None:
    argv = Sandbox("/usr/bin/bwrap", (), privileged=True).wrap(["true"], [slot], "/")
    assert argv[argv.index(closed) - 1] == "--tmpfs"
    assert argv.index(closed) < argv.index(slot)
    unprivileged = Sandbox("/usr/bin/bwrap", ()).wrap(["true"], [slot], "/")
    assert closed not in unprivileged  # the agent's own uid passes through its own dirs


@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
def test_a_hidden_file_reads_empty_in_the_sandbox() -> None:
    """A --secret-file outside the agent's home is hidden file by file."""
    top = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        secret = top / "cluster-secret"
        secret.write_text("s3cret")
        secret.chmod(0o644)  # even where the sandbox's uid could read it
        top.chmod(0o755)
        isolation = open_isolation("bwrap", [str(secret)], str(top / "state"),
                                   f"host_t{os.getpid()}")
        isolation.close()
        assert isolation.sandbox is not None
        identity = isolation.identities.allocate() if isolation.identities else None
        argv = isolation.sandbox.wrap(["/bin/cat", str(secret)], [], "/", identity=identity)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout == ""
    finally:
        shutil.rmtree(top)


def test_only_a_gpu_workspaces_kernel_sees_the_hosts_gpu_devices(tmp_path: Path) -> None:
    """The sandbox binds the GPU device nodes into a slot made for a workspace that
    asks for GPUs, and into no other (a CPU workspace cannot open a GPU)."""
    sandbox = Sandbox("/usr/bin/bwrap", (str(tmp_path),))
    devices = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")

    def argv(slot_devices: tuple[str, ...]) -> list[str]:
        slot = Slot.create(str(tmp_path / "rt"), str(tmp_path / "s"), f"s{len(slot_devices)}",
                           devices=slot_devices)
        kernel = new_kernel(slot, "k1", "ws", "python3", sandbox)
        return kernel.manager.format_kernel_cmd()

    gpu = argv(devices)
    for device in devices:
        at = gpu.index(device)
        assert gpu[at - 1] == "--dev-bind" and gpu[at + 1] == device
    assert not any(part.startswith("/dev/nvidia") for part in argv(()))
