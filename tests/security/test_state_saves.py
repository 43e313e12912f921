"""A suspend either saves the kernels' state or fails and says so (as root and as
an unprivileged user).

Measured before: the state was written to the workspace's own disk quota, a big
namespace met ENOSPC there, and the agent logged "could not flush its state" and
saved the workspace without it: the API said ``suspended`` with an empty snapshot,
and the resume restored nothing, in silence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.support.cluster import (
    Cluster,
    create_running,
    resume,
    run_cell,
    start_kernel,
    suspend,
    token_of,
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


#: The tenant puts a directory where the kernel writes its state's manifest: every
#: checkpoint (and suspend) of it fails until it is removed, as a full disk would.
BLOCK = ("import os\nd = os.environ['NBFLEET_STATE_DIR']\n"
         "if os.path.isfile(d + '/manifest.json'):\n    os.remove(d + '/manifest.json')\n"
         "os.makedirs(d + '/manifest.json/x')\ny = 2\n")


def test_a_cell_checkpoint_that_cannot_be_written_is_told_and_reported(
        cluster: Cluster) -> None:
    """Measured before: a checkpoint that failed was only logged by the agent; the
    workspace claimed nothing, and a lost host brought back an older state than the
    user believed. Now the cell's output says so, and so does the workspace (its
    last error and ``snapshot.checkpoint_failures``), until a checkpoint is kept."""
    client = cluster.new_user(org="unchecked", project="p")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    _out(cluster, client, ws, kernel, "x = 1")

    def snapshot() -> dict[str, Any]:
        found: dict[str, Any] = client.get(f"/v1/workspaces/{ws}").json()
        return found

    wait_until(lambda: snapshot()["snapshot"] and snapshot()["snapshot"]["cells"].get(kernel),
               60, 0.2, "the first cell's checkpoint")
    kept = snapshot()["snapshot"]["cells"][kernel]

    async def failing_cell() -> list[str]:
        sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
        try:
            request = sock.message("execute_request", {
                "code": BLOCK, "silent": False, "store_history": True,
                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}, "shell")
            await sock.send(request)
            msg_id = request["header"]["msg_id"]
            result = await sock.collect(msg_id)
            assert result.status == "ok", result.outputs
            told: list[str] = []
            deadline = asyncio.get_running_loop().time() + 60
            while not told and asyncio.get_running_loop().time() < deadline:
                msg = await sock.receive(60)
                if (msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id
                        and "could not be checkpointed" in msg["content"]["text"]):
                    told.append(msg["content"]["text"])
            return told
        finally:
            await sock.close()

    told = asyncio.run(failing_cell())
    assert told and "IsADirectoryError" in told[0], told
    body = wait_until(lambda: (lambda b: b if b["last_error"] else None)(snapshot()), 60, 0.2,
                      "the failure on the workspace")
    assert "checkpoint" in body["last_error"] and "IsADirectoryError" in body["last_error"]
    assert f"as of cell {kept}" in body["last_error"], body["last_error"]
    failure = body["snapshot"]["checkpoint_failures"][kernel]
    assert failure["cell"] > kept and "IsADirectoryError" in failure["reason"], failure
    assert body["snapshot"]["cells"][kernel] == kept, "the older state is still the kept one"
    assert body["state"] == "running"

    # Put right: the next checkpoint is kept and clears both.
    _out(cluster, client, ws, kernel, "import shutil\nshutil.rmtree(d + '/manifest.json')\nz = 3")
    cleared = wait_until(
        lambda: (lambda b: b if not b["last_error"]
                 and not b["snapshot"]["checkpoint_failures"] else None)(snapshot()),
        60, 0.2, "a kept checkpoint to clear the failure")
    assert cleared["snapshot"]["cells"][kernel] > failure["cell"], cleared["snapshot"]
