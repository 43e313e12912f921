"""Files that kernel code writes reach the blob store while the workspace runs,
not only at suspend: a host lost mid-session loses at most a few seconds of them."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from nbfleet.agent.runtimes import RuntimeManager
from nbfleet.sdk.kernel_socket import KernelSocket
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles
from tests.support.cluster import (
    Cluster,
    create_running,
    start_kernel,
    token_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

INTERVAL_S = 0.2


class CountingFiles(WorkspaceFiles):
    """A local store that records every upload (the sync's cost)."""

    def __init__(self, root: Path) -> None:
        super().__init__(BlobStore(str(root)))
        self.puts: list[str] = []

    def put(self, workspace_id: str, path: str, data: bytes) -> str:
        self.puts.append(path)
        return super().put(workspace_id, path, data)


@pytest.fixture
async def synced(tmp_path: Path) -> AsyncIterator[tuple[RuntimeManager, CountingFiles]]:
    """A runtime manager syncing every INTERVAL_S; its runtimes run no kernel (the
    test writes into the working directory as a kernel would)."""
    sockets = tempfile.mkdtemp(prefix="nbf-", dir="/tmp")  # IPC paths must stay short
    files = CountingFiles(tmp_path / "blobs")
    runtimes = RuntimeManager(str(tmp_path / "agent"), files, sockets,
                              file_sync_interval_s=INTERVAL_S)
    yield runtimes, files
    await runtimes.shutdown()
    shutil.rmtree(sockets, ignore_errors=True)


async def until(check: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def stored(files: WorkspaceFiles, workspace_id: str) -> dict[str, bytes]:
    return {b.key: files.get(workspace_id, b.key) for b in files.list(workspace_id)}


@pytest.mark.no_db
async def test_what_a_kernel_writes_is_synced_while_it_runs(
        synced: tuple[RuntimeManager, CountingFiles]) -> None:
    runtimes, files = synced
    files.put("ws_a", "seed.txt", b"from the store")
    placed = await runtimes.ensure("ws_a", 1, [])
    work = Path(placed.runtime.workdir)
    files.puts.clear()
    (work / "results").mkdir()
    (work / "results" / "out.csv").write_text("a,b\n1,2\n")
    await until(lambda: stored(files, "ws_a").get("results/out.csv") == b"a,b\n1,2\n")
    (work / "results" / "out.csv").write_text("a,b\n1,2\n3,4\n")
    (work / "seed.txt").unlink()
    await until(lambda: stored(files, "ws_a") == {"results/out.csv": b"a,b\n1,2\n3,4\n"})
    # Nothing changes: rounds go on, and upload nothing more (O(changes), not O(files)).
    uploads = len(files.puts)
    await asyncio.sleep(INTERVAL_S * 8)
    assert len(files.puts) == uploads == 2


@pytest.mark.no_db
async def test_a_planted_link_is_never_uploaded(
        synced: tuple[RuntimeManager, CountingFiles]) -> None:
    runtimes, files = synced
    placed = await runtimes.ensure("ws_b", 1, [])
    work = Path(placed.runtime.workdir)
    (work / "passwd").symlink_to("/etc/passwd")
    (work / "etc").symlink_to("/etc")
    (work / "marker.txt").write_text("synced after the links were seen")
    await until(lambda: "marker.txt" in stored(files, "ws_b"))
    await asyncio.sleep(INTERVAL_S * 5)
    assert stored(files, "ws_b") == {"marker.txt": b"synced after the links were seen"}
    assert not any("passwd" in path for path in files.puts)


@pytest.mark.no_db
async def test_an_api_write_is_not_uploaded_again_and_the_loop_ends_with_the_runtime(
        synced: tuple[RuntimeManager, CountingFiles]) -> None:
    runtimes, files = synced
    placed = await runtimes.ensure("ws_c", 1, [])
    task = placed.runtime.syncing
    assert task is not None and not task.done()
    # The API writes the store, then mirrors the file into the runtime (under the
    # workspace's lock, which the sync takes too).
    files.put("ws_c", "api.txt", b"saved by the API")
    files.puts.clear()
    await runtimes.write_file("ws_c", "api.txt", b"saved by the API")
    await asyncio.sleep(INTERVAL_S * 6)
    assert files.puts == []
    assert await runtimes.release("ws_c", 2, sync=False)
    assert task.done() and placed.runtime.syncing is None


@pytest.mark.no_db
async def test_an_interval_of_zero_syncs_only_at_release(tmp_path: Path) -> None:
    sockets = tempfile.mkdtemp(prefix="nbf-", dir="/tmp")
    files = CountingFiles(tmp_path / "blobs")
    runtimes = RuntimeManager(str(tmp_path / "agent"), files, sockets, file_sync_interval_s=0)
    try:
        placed = await runtimes.ensure("ws_d", 1, [])
        assert placed.runtime.syncing is None
        (Path(placed.runtime.workdir) / "late.txt").write_text("x")
        await asyncio.sleep(0.5)
        assert stored(files, "ws_d") == {}
        assert await runtimes.release("ws_d", 2)
        assert stored(files, "ws_d") == {"late.txt": b"x"}
    finally:
        await runtimes.shutdown()
        shutil.rmtree(sockets, ignore_errors=True)


def test_kernel_written_files_appear_in_the_api_without_a_suspend(
        shared_cluster: Cluster) -> None:
    """Through a real agent (its default interval) and the files API."""
    client = shared_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    url, token = shared_cluster.channels_url(ws, kernel), token_of(client)

    def listed() -> dict[str, int]:
        response = client.get(f"/v1/workspaces/{ws}/files")
        response.raise_for_status()
        return {f["path"]: f["size"] for f in response.json()["files"]}

    async def run(code: str) -> None:
        sock = await KernelSocket.connect(url, token)
        try:
            result = await sock.execute(code)
            assert result.status == "ok", result.reply
        finally:
            await sock.close()

    asyncio.run(run(
        "import os\n"
        "os.makedirs('out', exist_ok=True)\n"
        "open('out/result.txt', 'w').write('computed')\n"
        "os.symlink('/etc/passwd', 'passwd')\n"
        "os.symlink('/etc', 'etc')\n"))
    wait_until(lambda: "out/result.txt" in listed(), 15, what="the kernel's file in the API")
    assert client.get(f"/v1/workspaces/{ws}/files/out/result.txt").content == b"computed"
    time.sleep(3)  # a few more rounds: the links are never uploaded
    assert set(listed()) == {"out/result.txt"}
    asyncio.run(run("import os; os.remove('out/result.txt')"))
    wait_until(lambda: "out/result.txt" not in listed(), 15, what="the deletion in the API")
    assert client.get(f"/v1/workspaces/{ws}").json()["state"] == "running"  # no suspend
