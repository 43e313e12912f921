"""Kernel state that no snapshot names any more is deleted at the next suspend.

Every cell's checkpoint stores the values it changed (``agent/checkpoints.py``);
the blobs of the values they replaced used to stay in the store for the
workspace's whole life: a gigabyte per cell for a notebook updating a 1 GB model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from nbfleet.db.tables import Workspace
from nbfleet.storage.collect import snapshot_keys
from tests.conftest import running_cluster
from tests.support.cluster import (
    Cluster,
    create_running,
    outcome,
    resume,
    run_cell,
    start_kernel,
    suspend,
    wait_until,
)
from tests.support.credit_api import query

CHANGES = 3
DIGEST = "import hashlib; print(hashlib.sha256(kept + changing).hexdigest())"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("collect"),
                         control_args=("--idle-suspend", "0")) as running:
        yield running


def snapshot_of(cluster: Cluster, ws: str) -> dict[str, Any]:
    rows = query(cluster, select(Workspace.snapshot).where(Workspace.id == ws))
    return dict(rows[0][0] or {})


def checkpointed(cluster: Cluster, ws: str, kernel: str) -> int:
    """The last cell the kernel's saved state includes."""
    return int(snapshot_of(cluster, ws).get("kernels", {}).get(kernel, {}).get("cell", 0))


def stored(cluster: Cluster, ws: str, folder: str) -> set[str]:
    """The workspace's files under ``cas`` (blob digests) or ``snapshots`` (keys)."""
    root = cluster.home / "blobs"
    top = root / "workspaces" / ws / folder
    return {(path.name if folder == "cas" else str(path.relative_to(root)))
            for path in top.rglob("*") if path.is_file()}


def named(cluster: Cluster, ws: str) -> set[str]:
    """The blobs the workspace's current snapshot names: its manifests' and its
    package layer's."""
    digests: set[str] = set()
    for key in snapshot_keys(snapshot_of(cluster, ws)):
        if "/snapshots/" in key:
            manifest = json.loads((cluster.home / "blobs" / key).read_text())
            digests.update(manifest["blobs"])
        else:
            digests.add(key.rsplit("/", 1)[-1])
    return digests


def test_a_suspend_deletes_the_state_that_no_snapshot_names(cluster: Cluster) -> None:
    client = cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    run_cell(cluster, client, ws, kernel, "import os\nkept = os.urandom(300_000)")
    for change in range(CHANGES):
        run_cell(cluster, client, ws, kernel, "changing = os.urandom(300_000)")
        wait_until(lambda cell=change + 2: checkpointed(cluster, ws, kernel) >= cell, 30, 0.2,
                   f"the checkpoint of change {change}")
    last_checkpoint = named(cluster, ws)
    replaced = stored(cluster, ws, "cas") - last_checkpoint
    # Each change's checkpoint left the value it replaced behind.
    assert len(replaced) >= CHANGES - 1, replaced
    expected = outcome(run_cell(cluster, client, ws, kernel, DIGEST))

    suspend(client, ws)
    left = stored(cluster, ws, "cas")
    assert not replaced & left, "a replaced value's blob is still stored"
    # What the new snapshot names is all there; beside it, at most what the one
    # before it named (kept until the suspend was recorded).
    assert named(cluster, ws) <= left <= named(cluster, ws) | last_checkpoint
    manifests = stored(cluster, ws, "snapshots")
    assert snapshot_keys(snapshot_of(cluster, ws)) <= manifests and len(manifests) <= 2

    resume(client, ws)
    assert outcome(run_cell(cluster, client, ws, kernel, DIGEST)) == expected
