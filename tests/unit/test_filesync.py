"""The runtime's copy of workspace files: written atomically under any name the
API accepts, and the agent's half-written files never synced back."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from nbfleet.agent import filesync
from nbfleet.agent.livesync import LiveSync, Settling
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles


@pytest.mark.no_db
def test_the_longest_names_the_api_accepts_are_written(tmp_path: Path) -> None:
    name = "n" * 255  # the API's limit per segment; "<name>.tmp" would pass it
    stamp = filesync.write_local(str(tmp_path), f"dir/{name}", b"data")
    assert (tmp_path / "dir" / name).read_bytes() == b"data"
    assert stamp[0] == 4
    assert [p.name for p in (tmp_path / "dir").iterdir()] == [name]  # no temporary left


@pytest.mark.no_db
def test_half_written_files_are_not_synced_back(tmp_path: Path) -> None:
    (tmp_path / "kept.txt").write_text("k")
    (tmp_path / f"{filesync.TMP_PREFIX}abc").write_text("partial")
    assert set(filesync.scan(str(tmp_path))) == {"kept.txt"}


# ------------------------------------------------ the live runtime's periodic sync
class CountingFiles(WorkspaceFiles):
    """A local store that counts what it is asked to write."""

    def __init__(self, root: Path) -> None:
        super().__init__(BlobStore(str(root)))
        self.puts: list[str] = []
        self.fail = False

    def put(self, workspace_id: str, path: str, data: bytes) -> str:
        if self.fail:
            raise OSError("the store is down")
        self.puts.append(path)
        return super().put(workspace_id, path, data)


def stored(files: WorkspaceFiles) -> dict[str, bytes]:
    return {b.key: files.get("ws", b.key) for b in files.list("ws")}


@pytest.mark.no_db
def test_sync_paths_uploads_only_what_changed_and_deletes_what_went(tmp_path: Path) -> None:
    work, files = tmp_path / "work", CountingFiles(tmp_path / "blobs")
    work.mkdir()
    (work / "kept.txt").write_text("same")
    (work / "sub").mkdir()
    (work / "sub" / "new.txt").write_text("new")
    (work / "gone.txt").write_text("old")
    manifest = filesync.sync_back(files, "ws", str(work), {})
    files.puts.clear()
    (work / "sub" / "new.txt").write_text("newer!")
    (work / "gone.txt").unlink()
    (work / "made.txt").write_text("made")
    changed = ["gone.txt", "made.txt", "sub/new.txt", "kept.txt"]  # kept.txt: unchanged
    filesync.sync_paths(files, "ws", str(work), manifest, changed)
    assert sorted(files.puts) == ["made.txt", "sub/new.txt"]
    assert stored(files) == {"kept.txt": b"same", "made.txt": b"made", "sub/new.txt": b"newer!"}
    assert manifest == filesync.scan(str(work))


@pytest.mark.no_db
def test_sync_paths_never_uploads_through_a_planted_link(tmp_path: Path) -> None:
    work, files = tmp_path / "work", CountingFiles(tmp_path / "blobs")
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    manifest = filesync.sync_back(files, "ws", str(work), {})
    (work / "notes.txt").unlink()
    (work / "notes.txt").symlink_to("/etc/passwd")  # swapped for a link to a host file
    (work / "passwd").symlink_to("/etc/passwd")
    (work / "etc").symlink_to("/etc")  # a directory link: etc/passwd must not be read
    filesync.sync_paths(files, "ws", str(work), manifest, ["notes.txt", "passwd", "etc/passwd"])
    assert stored(files) == {}  # the link is no regular file: notes.txt is gone
    assert files.puts == ["notes.txt"] and manifest == {}  # (the first sync's put)


@pytest.mark.no_db
def test_sync_paths_deletes_nothing_when_the_working_directory_is_gone(tmp_path: Path) -> None:
    work, files = tmp_path / "work", CountingFiles(tmp_path / "blobs")
    work.mkdir()
    (work / "a.txt").write_text("a")
    manifest = filesync.sync_back(files, "ws", str(work), {})
    shutil.rmtree(work)  # a runtime going away, not the kernel deleting its files
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"])
    assert stored(files) == {"a.txt": b"a"} and "a.txt" in manifest


@pytest.mark.no_db
def test_sync_paths_keeps_what_it_did_when_the_store_fails(tmp_path: Path) -> None:
    work, files = tmp_path / "work", CountingFiles(tmp_path / "blobs")
    work.mkdir()
    (work / "a.txt").write_text("a")
    manifest: filesync.Manifest = {}
    files.fail = True
    with pytest.raises(OSError, match="down"):
        filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"])
    assert manifest == {}  # not recorded: the next round tries again
    files.fail = False
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"])
    assert stored(files) == {"a.txt": b"a"} and manifest == filesync.scan(str(work))


def restamp(path: Path, data: bytes) -> None:
    """Write ``data`` again with a new mtime (a kernel rewriting a file, a touch)."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


@pytest.mark.no_db
def test_sync_paths_does_not_upload_bytes_it_uploaded_already(tmp_path: Path) -> None:
    work, files = tmp_path / "work", CountingFiles(tmp_path / "blobs")
    work.mkdir()
    (work / "a.txt").write_text("same")
    manifest: filesync.Manifest = {}
    digests: filesync.Digests = {}
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"], digests)
    assert files.puts == ["a.txt"]
    restamp(work / "a.txt", b"same")  # the same bytes written again
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"], digests)
    assert files.puts == ["a.txt"] and manifest == filesync.scan(str(work))
    restamp(work / "a.txt", b"other")  # new bytes: uploaded
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"], digests)
    assert files.puts == ["a.txt", "a.txt"] and stored(files) == {"a.txt": b"other"}
    # An API write changes the store behind the digest (and the manifest's stamp):
    # the kernel writing the old bytes back is uploaded, or the store would keep the
    # API's.
    files.put("ws", "a.txt", b"from the API")
    manifest["a.txt"] = filesync.write_local(str(work), "a.txt", b"from the API")
    files.puts.clear()
    restamp(work / "a.txt", b"other")
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"], digests)
    assert files.puts == ["a.txt"] and stored(files) == {"a.txt": b"other"}
    # Removed, then written again with the same bytes: uploaded again.
    (work / "a.txt").unlink()
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"], digests)
    assert stored(files) == {} and digests == {}
    (work / "a.txt").write_bytes(b"other")
    filesync.sync_paths(files, "ws", str(work), manifest, ["a.txt"], digests)
    assert files.puts == ["a.txt", "a.txt"] and stored(files) == {"a.txt": b"other"}


@pytest.mark.no_db
async def test_live_sync_does_not_upload_a_file_rewritten_with_the_same_bytes(
        tmp_path: Path) -> None:
    work, files = tmp_path / "work", CountingFiles(tmp_path / "blobs")
    work.mkdir()
    manifest: filesync.Manifest = {}
    loop = LiveSync(files, "ws", lambda: str(work), lambda: manifest, lambda: True,
                    asyncio.Lock(), interval_s=2.0)
    (work / "out.csv").write_bytes(b"a,b\n1,2\n")
    assert await loop.round() == []  # seen once: may still be written
    assert await loop.round() == ["out.csv"]
    assert files.puts == ["out.csv"]
    for _ in range(3):  # a cell run again, writing what it wrote before
        restamp(work / "out.csv", b"a,b\n1,2\n")
        assert await loop.round() == []
        assert await loop.round() == ["out.csv"]  # settled, read, and not uploaded
        assert manifest == filesync.scan(str(work))
    assert files.puts == ["out.csv"]
    restamp(work / "out.csv", b"a,b\n1,2\n3,4\n")
    await loop.round()
    await loop.round()
    assert files.puts == ["out.csv", "out.csv"]
    assert stored(files) == {"out.csv": b"a,b\n1,2\n3,4\n"}


@pytest.mark.no_db
def test_a_path_is_synced_once_it_stops_changing() -> None:
    settling = Settling(max_wait_s=10.0)
    manifest: filesync.Manifest = {"old.txt": (1, 1), "gone.txt": (2, 2)}
    first = {"old.txt": (1, 1), "new.txt": (5, 100)}
    assert settling.ready(first, manifest, now=0.0) == []  # seen once: may still be written
    second = {"old.txt": (1, 1), "new.txt": (9, 200)}  # grew meanwhile: still being written
    assert settling.ready(second, manifest, now=2.0) == ["gone.txt"]  # gone at both scans
    assert settling.ready(second, manifest, now=4.0) == ["gone.txt", "new.txt"]
    manifest = {"old.txt": (1, 1), "new.txt": (9, 200)}  # what a sync records
    assert settling.ready(second, manifest, now=6.0) == [] and settling.since == {}


@pytest.mark.no_db
def test_a_path_that_never_stops_changing_is_synced_after_the_longest_wait() -> None:
    settling = Settling(max_wait_s=10.0)
    readies = [settling.ready({"log.txt": (i, i)}, {}, now=2.0 * i) for i in range(8)]
    assert readies == [[], [], [], [], [], ["log.txt"], ["log.txt"], ["log.txt"]]
