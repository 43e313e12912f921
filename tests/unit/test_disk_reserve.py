"""Thin workspace disks keep the platform's own disk by a reserve of free space:
a slot is refused, with the reason, while the host has less free."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from nbfleet.agent.sandbox.quota import DiskQuotas
from nbfleet.model.errors import Conflict


def test_a_host_short_of_disk_refuses_a_new_slot_and_says_why(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    DiskQuotas(str(tmp_path), reserve_bytes=free // 2).check_reserve()  # room: no error
    with pytest.raises(Conflict, match="short of disk for another workspace") as refused:
        DiskQuotas(str(tmp_path), reserve_bytes=free + (1 << 30)).check_reserve()
    assert "stay reserved for the platform" in refused.value.detail


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
                    reason="loop mounts need root and e2fsprogs")
def test_quotas_still_open_on_a_host_short_of_disk(tmp_path: Path) -> None:
    """The start-up probe is not a workspace: a laptop below the reserve still runs
    the agent (its placements are refused, with the reason, until disk is freed)."""
    quotas = DiskQuotas.open(str(tmp_path / "disks"), reserve_bytes=1 << 60)
    with pytest.raises(Conflict):
        quotas.check_reserve()


def test_leftovers_a_tenant_made_unwritable_are_removed_all_the_same(tmp_path: Path) -> None:
    """An unprivileged agent's kernels are its own uid: a kernel that left
    ``chmod 0500`` (or 0000) directories must not keep the agent from starting."""
    from nbfleet.agent.sandbox.quota import remove_leftovers

    leftover = tmp_path / "runtimes"
    locked = leftover / "ws" / "files" / "locked"
    locked.mkdir(parents=True)
    (locked / "a.txt").write_text("x")
    hidden = leftover / "ws" / "files" / "hidden"
    hidden.mkdir()
    (hidden / "b.txt").write_text("y")
    os.chmod(locked, 0o500)
    os.chmod(hidden, 0)
    remove_leftovers(str(leftover))
    assert not leftover.exists()
