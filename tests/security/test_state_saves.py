"""A suspend either saves the kernels' state or fails and says so (as root and as
an unprivileged user).

Measured before: the state was written to the workspace's own disk quota, a big
namespace met ENOSPC there, and the agent logged "could not flush its state" and
saved the workspace without it: the API said ``suspended`` with an empty snapshot,
and the resume restored nothing, in silence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import (
    Cluster,
    create_running,
    resume,
    run_cell,
    start_kernel,
    suspend,
    wait_until,
)
from tests.support.hostile import NEEDS_BWRAP
from tests.support.sandboxed import platform_as

pytestmark = [
    NEEDS_BWRAP,
    pytest.mark.no_db,  # the metadata DB is incidental
    pytest.mark.timeout(300),
]

DISK_MIB = 48


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with platform_as(request.param, "nbf-saves-") as cluster:
        cluster.start_agent(args=("--sandbox", "bwrap", "--kernel-memory", "1GiB",
                                  "--workspace-disk", f"{DISK_MIB}MiB"))
        yield cluster


def _out(cluster: Cluster, client: httpx.Client, ws: str, kernel: str, code: str) -> str:
    result = run_cell(cluster, client, ws, kernel, code)
    assert result.status == "ok", (result.reply, result.outputs)
    return result.stdout


def test_a_suspend_whose_state_cannot_be_written_fails_and_keeps_the_kernel(
        cluster: Cluster) -> None:
    """The kernel's own state directory made unwritable (by the tenant itself, the
    way a full disk refuses it): the suspend must fail with the reason, the kernel
    must go on running with its variables, and a later suspend must save them."""
    client = cluster.new_user(org="unsaved", project="p")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    _out(cluster, client, ws, kernel,
         "import os\nx = 41\nos.chmod(os.environ['NBFLEET_STATE_DIR'], 0o500)")
    client.post(f"/v1/workspaces/{ws}/suspend").raise_for_status()

    def failed() -> dict[str, Any] | None:
        body: dict[str, Any] = client.get(f"/v1/workspaces/{ws}").json()
        return body if body["state"] == "running" and body["last_error"] else None

    body = wait_until(failed, 90, 0.2, "the suspend to fail")
    assert body["desired_state"] == "running", body
    assert "could not write its variables" in body["last_error"], body
    assert "Permission denied" in body["last_error"], body
    assert _out(cluster, client, ws, kernel, "print(x + 1)") == "42\n"

    _out(cluster, client, ws, kernel, "os.chmod(os.environ['NBFLEET_STATE_DIR'], 0o700)")
    assert suspend(client, ws)["state"] == "suspended"
    restored = resume(client, ws)["restore"]["kernels"][kernel]
    assert "x" in restored["restored"], restored
    assert _out(cluster, client, ws, kernel, "print(x + 1)") == "42\n"


def test_a_namespace_larger_than_the_workspace_disk_is_saved(cluster: Cluster) -> None:
    """As root every workspace has a disk quota; the kernels' state does not count
    against it (the measured failure: ENOSPC on the quota, every variable lost)."""
    client = cluster.new_user(org="big", project="p")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    size = (DISK_MIB + 32) << 20
    digest = _out(cluster, client, ws, kernel,
                  f"import hashlib, os\nx = os.urandom({size})\n"
                  "print(hashlib.sha256(x).hexdigest())")
    body = suspend(client, ws)
    assert body["state"] == "suspended", body
    assert body["snapshot"]["bytes"] >= size, body["snapshot"]
    restored = resume(client, ws)["restore"]["kernels"][kernel]
    assert "x" in restored["restored"], restored
    assert _out(cluster, client, ws, kernel,
                "print(hashlib.sha256(x).hexdigest())") == digest
