"""GPU device plumbing without a sandbox: the nodes found, the device-cgroup rules
written at bind and release, and who holds a GPU after its release.

The sandboxed, root-only half (real cgroups, real kernels) is
``tests/security/test_gpu_isolation.py``."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from nbfleet.agent.bindings import KernelBindings
from nbfleet.agent.sandbox import gpus as gpus_module
from nbfleet.agent.sandbox.cgroups import CONTROLLERS, Cgroup
from nbfleet.agent.sandbox.command import Sandbox
from nbfleet.agent.sandbox.devices import (
    DEVICE_DIR_ENV,
    NVIDIA_MAJOR,
    GpuNode,
    gpu_nodes,
    gpu_paths,
    held,
)
from nbfleet.agent.sandbox.gpus import HostGpus
from nbfleet.protocol.gpu import CellBinding

pytestmark = pytest.mark.no_db

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")

NODES = (GpuNode("/d/nvidia0", NVIDIA_MAJOR, 0, 0), GpuNode("/d/nvidia1", NVIDIA_MAJOR, 1, 1),
         GpuNode("/d/nvidiactl", NVIDIA_MAJOR, 255, None))


def test_v1_device_rules_are_written_to_the_slots_device_cgroup(tmp_path: Path) -> None:
    dirs = tuple(str(tmp_path / c) for c in CONTROLLERS)
    devices = tmp_path / "devices"
    devices.mkdir()
    group = Cgroup(1, dirs, str(devices))
    assert group.procs_files[-1] == str(devices / "cgroup.procs")
    group.allow(["c 195:0 rw"])
    assert (devices / "devices.allow").read_text() == "c 195:0 rw"
    group.deny(["c 195:0 rw"])
    assert (devices / "devices.deny").read_text() == "c 195:0 rw"
    Cgroup(1, dirs).allow(["c 195:1 rw"])  # no device cgroup: nothing to write
    assert (devices / "devices.allow").read_text() == "c 195:0 rw"


@ROOT
def test_the_nodes_are_found_in_the_directory_named(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name, minor in (("nvidia0", 0), ("nvidia3", 3), ("nvidiactl", 255)):
        os.mknod(tmp_path / name, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
    (tmp_path / "nvidia-caps").mkdir()
    os.mknod(tmp_path / "nvidia-caps" / "nvidia-cap1", 0o444 | stat.S_IFCHR,
             os.makedev(240, 1))
    (tmp_path / "nvidia-notes").write_text("not a device")
    monkeypatch.setenv(DEVICE_DIR_ENV, str(tmp_path))
    found = {(os.path.basename(n.path), n.major, n.minor, n.index) for n in gpu_nodes()}
    assert found == {("nvidia0", 195, 0, 0), ("nvidia3", 195, 3, 3),
                     ("nvidiactl", 195, 255, None), ("nvidia-cap1", 240, 1, None)}
    assert [os.path.basename(p) for p in gpu_paths()] == [
        "nvidia-caps", "nvidia-notes", "nvidia0", "nvidia3", "nvidiactl"]


@ROOT
def test_a_descriptor_of_a_node_is_seen_until_closed(tmp_path: Path) -> None:
    os.mknod(tmp_path / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 0))
    (node,) = gpu_nodes(str(tmp_path))
    fd = os.open(tmp_path / "nvidia0", os.O_PATH)
    try:
        assert held([os.getpid()], [node]) == {node}
    finally:
        os.close(fd)
    assert held([os.getpid()], [node]) == set()
    assert held([2 ** 22 + 1], [node]) == set()  # no such process: holds nothing


@dataclass
class FakeCgroup:
    """What the slot's device cgroup was told, in order."""

    devices: str | None = "/fake"
    writes: list[str] = field(default_factory=list)
    procs_files: list[str] = field(default_factory=list)

    def allow(self, rules: list[str]) -> None:
        self.writes += [f"+{r}" for r in rules]

    def deny(self, rules: list[str]) -> None:
        self.writes += [f"-{r}" for r in rules]


def cell(task_id: str, *indices: int) -> CellBinding:
    return CellBinding(task_id=task_id, host_id="h", gpu_indices=indices)


async def settle() -> None:
    """Let the check at release (a thread hop) run."""
    for _ in range(20):
        await asyncio.sleep(0.01)


async def until(check: Callable[[], bool]) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


async def test_a_bind_opens_its_gpus_and_the_release_closes_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus_module, "_held_in", lambda procs, nodes: set())
    group = FakeCgroup()
    bindings = KernelBindings()
    bindings.gpus = HostGpus(NODES).slot(cast(Cgroup, group))
    released: list[str] = []
    bindings.on_release = released.extend
    bindings.start("m1", cell("k/m1", 1))
    assert group.writes == ["+c 195:1 rw", "+c 195:255 rw"]
    bindings.end("m1")
    assert group.writes[2:] == ["-c 195:1 rw", "-c 195:255 rw"]
    await until(lambda: bool(released))
    assert released == ["k/m1"] and bindings.active("k") == []


async def test_a_gpu_held_after_release_stays_the_slots_until_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    holding: set[GpuNode] = {NODES[0]}
    monkeypatch.setattr(gpus_module, "_held_in",
                        lambda procs, nodes: {n for n in nodes if n in holding})
    monkeypatch.setattr(gpus_module, "RECHECK_S", 0.0)
    host = HostGpus(NODES)
    mine, theirs = FakeCgroup(), FakeCgroup()
    a, b = KernelBindings(), KernelBindings()
    a.gpus, b.gpus = host.slot(cast(Cgroup, mine)), host.slot(cast(Cgroup, theirs))
    released: list[str] = []
    a.on_release = b.on_release = released.extend
    a.start("m1", cell("a/m1", 0))
    a.end("m1")
    await settle()
    assert released == [] and [x.held for x in a.active("a")] == [True]
    # Another slot bound to GPU 0 meanwhile: its cgroup is not opened to it.
    b.start("m2", cell("b/m2", 0))
    assert theirs.writes == []
    holding.clear()  # closed: reported, and handed to the slot waiting for it
    await until(lambda: bool(released))
    assert released == ["a/m1"] and a.active("a") == []
    assert theirs.writes == ["+c 195:0 rw", "+c 195:255 rw"]
    assert host.owner(0) is b.gpus


async def test_binding_the_held_gpu_again_ends_the_old_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus_module, "_held_in", lambda procs, nodes: set(nodes))
    monkeypatch.setattr(gpus_module, "RECHECK_S", 0.0)
    bindings = KernelBindings()
    bindings.gpus = HostGpus(NODES).slot(cast(Cgroup, FakeCgroup()))
    released: list[str] = []
    bindings.on_release = released.extend
    bindings.start("m1", cell("k/m1", 0))
    bindings.end("m1")
    await settle()
    assert released == []
    bindings.start("m2", cell("k/m2", 0))  # committed to the next cell now
    assert released == ["k/m1"]
    assert [(x.binding.task_id, x.held) for x in bindings.active("k")] == [("k/m2", False)]


async def test_without_a_cgroup_nothing_is_held() -> None:
    bindings = KernelBindings()
    bindings.gpus = HostGpus(NODES).slot(None)
    released: list[str] = []
    bindings.on_release = released.extend
    bindings.start("m1", cell("k/m1", 0))
    bindings.end("m1")
    assert released == ["k/m1"] and not bindings.gpus.enforced


def test_nodes_from_another_directory_appear_under_dev_in_the_sandbox() -> None:
    for privileged in (False, True):
        argv = Sandbox("bwrap", (), privileged=privileged).wrap(
            ["true"], [], "/", devices=["/var/tmp/gpus/nvidia0"])
        binds = [tuple(argv[i + 1:i + 3]) for i, part in enumerate(argv) if part == "--dev-bind"]
        assert binds == ([("/var/tmp/gpus/nvidia0", "/dev/nvidia0"),
                          ("/dev/nvidia0", "/dev/nvidia0")] if privileged
                         else [("/var/tmp/gpus/nvidia0", "/dev/nvidia0")]), argv
