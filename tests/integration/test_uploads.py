"""File uploads stream: the control plane's memory stays bounded whatever a body's
size, a body past the limit is refused with 413 as it arrives, and a refused upload
leaves nothing behind. Measured on a real control plane process."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from nbfleet.storage.blobs import STAGING
from nbfleet.storage.files import MAX_FILE_BYTES
from tests.support.cluster import Cluster, create_running, outcome, run_cell, start_kernel

MIB = 1024 * 1024
#: The most the control plane's resident memory may grow while bodies arrive.
RSS_BUDGET = 150 * MIB


def rss(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmHWM``: its peak so far), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class PeakRss:
    """Samples a process's RSS every few milliseconds while in use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = rss(pid)
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def chunks(total: int, size: int = MIB, fill: bytes = b"x") -> Iterator[bytes]:
    """A body without a Content-Length: httpx sends it chunked."""
    block = fill * size
    sent = 0
    while sent < total:
        piece = block[: min(size, total - sent)]
        sent += len(piece)
        yield piece


@pytest.fixture(scope="module")
def owner(shared_cluster: Cluster) -> tuple[httpx.Client, str]:
    client = shared_cluster.new_user(org="uploads", project="p")
    return client, create_running(client)


def staged(cluster: Cluster) -> list[str]:
    staging = cluster.home / "blobs" / STAGING
    return sorted(os.listdir(staging)) if staging.exists() else []


def assert_413(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text[:500]
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["title"] == "Content too large"


def test_a_body_past_the_limit_is_refused_in_bounded_memory(
        shared_cluster: Cluster, owner: tuple[httpx.Client, str]) -> None:
    client, ws = owner
    assert shared_cluster.control is not None
    url = f"/v1/workspaces/{ws}/files/huge.bin"
    client.put(url, content=b"the previous version")
    with PeakRss(shared_cluster.control.pid) as memory:
        # 300 MB without a Content-Length, so only counting can stop it.
        assert_413(client.put(url, content=chunks(3 * MAX_FILE_BYTES)))
    assert memory.growth < RSS_BUDGET, f"RSS grew {memory.growth / MIB:.0f} MiB"
    # A declared length past the limit is refused before a byte is read.
    assert_413(client.put(url, content=chunks(3 * MAX_FILE_BYTES),
                          headers={"Content-Length": str(3 * MAX_FILE_BYTES)}))
    # Nothing partial: the previous version stands, no temporary file is left.
    assert client.get(url).content == b"the previous version"
    assert staged(shared_cluster) == []
    files = client.get(f"/v1/workspaces/{ws}/files").json()["files"]
    assert [f["path"] for f in files if "huge" in f["path"]] == ["huge.bin"]


def test_a_refused_new_file_leaves_nothing(shared_cluster: Cluster,
                                           owner: tuple[httpx.Client, str]) -> None:
    client, ws = owner
    url = f"/v1/workspaces/{ws}/files/fresh/dir/too-big.bin"
    assert_413(client.put(url, content=chunks(MAX_FILE_BYTES + MIB)))
    assert client.get(url).status_code == 404
    assert staged(shared_cluster) == []
    paths = [f["path"] for f in client.get(f"/v1/workspaces/{ws}/files").json()["files"]]
    assert not [p for p in paths if p.startswith("fresh/")]
    assert not (shared_cluster.home / "blobs" / "workspaces" / ws / "files" / "fresh").exists()


def test_concurrent_uploads_of_allowed_size_succeed_in_bounded_memory(
        shared_cluster: Cluster, owner: tuple[httpx.Client, str]) -> None:
    client, ws = owner
    assert shared_cluster.control is not None
    size = 40 * MIB
    bodies = {f"concurrent/{n}.bin": bytes([65 + n]) for n in range(4)}

    def upload(path: str) -> httpx.Response:
        return client.put(f"/v1/workspaces/{ws}/files/{path}",
                          content=chunks(size, fill=bodies[path]))

    with PeakRss(shared_cluster.control.pid) as memory, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(upload, bodies))
    for path, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"path": path, "size": size}
    assert memory.growth < RSS_BUDGET, f"RSS grew {memory.growth / MIB:.0f} MiB"
    for path, fill in bodies.items():
        data = client.get(f"/v1/workspaces/{ws}/files/{path}").content
        assert data == fill * size
    assert staged(shared_cluster) == []


def test_exactly_the_limit_is_accepted(shared_cluster: Cluster,
                                       owner: tuple[httpx.Client, str]) -> None:
    client, ws = owner
    url = f"/v1/workspaces/{ws}/files/limit.bin"
    answer = client.put(url, content=chunks(MAX_FILE_BYTES))
    assert answer.status_code == 200 and answer.json()["size"] == MAX_FILE_BYTES
    assert_413(client.put(url, content=chunks(MAX_FILE_BYTES + 1)))
    listed = {f["path"]: f["size"] for f in client.get(f"/v1/workspaces/{ws}/files").json()
              ["files"]}
    assert listed["limit.bin"] == MAX_FILE_BYTES
    client.delete(url)


def test_a_streamed_upload_reaches_the_running_kernel_whole(
        shared_cluster: Cluster, owner: tuple[httpx.Client, str]) -> None:
    """The runtime's copy is streamed from the upload's file, in several pieces."""
    client, ws = owner
    data = os.urandom(3 * MIB + 12345)
    # '?', '%' and '#' must reach the agent as part of the name, not as URL syntax.
    name = "sub dir/weird?name #1 100%.bin"
    answer = client.put(f"/v1/workspaces/{ws}/files/{quote(name)}", content=data)
    assert answer.status_code == 200 and answer.json()["path"] == name
    kernel = start_kernel(client, ws)
    code = f"import hashlib; print(hashlib.sha256(open({name!r}, 'rb').read()).hexdigest())"
    result = outcome(run_cell(shared_cluster, client, ws, kernel, code))
    assert result == hashlib.sha256(data).hexdigest() + "\n"


def test_the_agent_bounds_a_runtime_copy_the_same_way(shared_cluster: Cluster,
                                                       owner: tuple[httpx.Client, str]) -> None:
    """Only the control plane calls the agent, but its file route holds a body in
    memory (the runtime's copy needs the bytes): it must stop at the file limit."""
    _client, ws = owner
    (agent,) = shared_cluster.admin().get("/v1/admin/agents").json()["items"]
    secret = (shared_cluster.home / "cluster-secret").read_text().strip()
    agent_process = shared_cluster.agents["agent1"]
    with httpx.Client(base_url=agent["url"], timeout=120,
                      headers={"Authorization": f"Bearer {secret}"}) as http:
        url = f"/agent/v1/runtimes/{ws}/files/huge.bin"
        with PeakRss(agent_process.pid) as memory:
            assert_413(http.put(url, content=chunks(3 * MAX_FILE_BYTES)))
        assert_413(http.put(url, content=chunks(MAX_FILE_BYTES + 1),
                            headers={"Content-Length": str(MAX_FILE_BYTES + 1)}))
    # At most the limit itself was held, never the 300 MB sent.
    assert memory.growth < MAX_FILE_BYTES + 50 * MIB, f"RSS grew {memory.growth / MIB:.0f} MiB"
