"""What a slot's cgroup writes and reads, on both hierarchies.

This project's machines have cgroup v1 (the hostile suite exercises it for real);
v2 is checked here against its interface files."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbfleet.agent.sandbox.cgroups import CONTROLLERS, Cgroup
from nbfleet.model.limits import Limits

pytestmark = pytest.mark.no_db


def test_v2_limits_and_oom_count(tmp_path: Path) -> None:
    group = Cgroup(2, (str(tmp_path),))
    group.apply(Limits(memory_bytes=1 << 30, cpus=1.5, pids=64))
    assert (tmp_path / "memory.max").read_text() == str(1 << 30)
    assert (tmp_path / "memory.swap.max").read_text() == "0"
    assert (tmp_path / "cpu.max").read_text() == "150000 100000"
    assert (tmp_path / "pids.max").read_text() == "64"
    group.apply(Limits())  # lifted
    assert (tmp_path / "memory.max").read_text() == "max"
    assert (tmp_path / "cpu.max").read_text() == "max 100000"
    assert (tmp_path / "pids.max").read_text() == "max"
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert group.oom_kills() == 2
    assert group.procs_files == [str(tmp_path / "cgroup.procs")]


def test_v1_writes_each_controller_in_its_own_hierarchy(tmp_path: Path) -> None:
    dirs = tuple(str(tmp_path / c) for c in CONTROLLERS)
    for directory in dirs:
        Path(directory).mkdir()
    (tmp_path / "memory" / "memory.memsw.limit_in_bytes").write_text("-1")
    group = Cgroup(1, dirs)
    group.apply(Limits(memory_bytes=512 << 20, cpus=1, pids=128))
    assert (tmp_path / "memory" / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert (tmp_path / "memory" / "memory.memsw.limit_in_bytes").read_text() == str(512 << 20)
    assert (tmp_path / "cpu" / "cpu.cfs_quota_us").read_text() == "100000"
    assert (tmp_path / "pids" / "pids.max").read_text() == "128"
    (tmp_path / "memory" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert group.oom_kills() == 5
    assert group.procs_files == [f"{d}/cgroup.procs" for d in dirs]
