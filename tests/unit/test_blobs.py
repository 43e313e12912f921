"""BlobStore over a local directory."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from nbfleet.model.errors import InvalidInput, NotFound
from nbfleet.storage.blobs import BlobStore


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "blobs"


@pytest.fixture
def store(root: Path) -> BlobStore:
    return BlobStore(str(root))


def _temp_files(root: Path) -> list[str]:
    return [name for _, _, files in os.walk(root) for name in files if name.startswith(".tmp-")]


def test_creates_root(root: Path, store: BlobStore) -> None:
    assert root.is_dir()
    assert store.local


def test_put_get_round_trip(store: BlobStore) -> None:
    store.put("a/b/c.bin", b"\x00\x01payload")
    assert store.get("a/b/c.bin") == b"\x00\x01payload"
    assert store.exists("a/b/c.bin")


def test_put_overwrites(store: BlobStore) -> None:
    store.put("k", b"one")
    store.put("k", b"two")
    assert store.get("k") == b"two"


def test_put_empty(store: BlobStore) -> None:
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.exists("empty")


def test_get_missing_raises_not_found(store: BlobStore) -> None:
    with pytest.raises(NotFound):
        store.get("nope")


def test_get_directory_raises_not_found(store: BlobStore) -> None:
    store.put("dir/file", b"x")
    with pytest.raises(NotFound):
        store.get("dir")
    assert not store.exists("dir")


def test_exists_false_for_missing(store: BlobStore) -> None:
    assert not store.exists("missing")


def test_delete(store: BlobStore) -> None:
    store.put("k", b"v")
    store.delete("k")
    assert not store.exists("k")
    with pytest.raises(NotFound):
        store.get("k")


def test_delete_missing_raises_not_found(store: BlobStore) -> None:
    with pytest.raises(NotFound):
        store.delete("missing")


def test_list_is_relative_and_sorted(store: BlobStore) -> None:
    for key in ["p/z.txt", "p/a/2.txt", "p/a/1.txt", "p/m", "other/x", "pp/y"]:
        store.put(key, key.encode())
    listed = store.list("p")
    assert [blob.key for blob in listed] == ["a/1.txt", "a/2.txt", "m", "z.txt"]
    assert [blob.size for blob in listed] == [len(b"p/a/1.txt"), len(b"p/a/2.txt"), 3, 7]
    assert [blob.key for blob in store.list("p/")] == [blob.key for blob in listed]
    assert [blob.key for blob in store.list("p/a")] == ["1.txt", "2.txt"]


def test_list_reports_utc_modification_time(store: BlobStore) -> None:
    store.put("p/f", b"x")
    (blob,) = store.list("p")
    assert blob.modified is not None
    assert blob.modified.utcoffset() == timedelta(0)


def test_list_missing_prefix_is_empty(store: BlobStore) -> None:
    assert store.list("nothing/here") == []


def test_delete_prefix_removes_only_that_prefix(store: BlobStore) -> None:
    for key in ["ws/1/a", "ws/1/sub/b", "ws/10/c", "ws/1x", "other"]:
        store.put(key, b"x")
    store.delete_prefix("ws/1")
    assert store.list("ws/1") == []
    assert store.exists("ws/10/c")
    assert store.exists("ws/1x")
    assert store.exists("other")


def test_delete_prefix_missing_is_a_no_op(store: BlobStore) -> None:
    store.put("keep", b"x")
    store.delete_prefix("nothing")
    assert store.exists("keep")


# --------------------------------------------------------------------------- atomicity


def _boom(*_args: object, **_kwargs: object) -> None:
    raise OSError("simulated crash")


@pytest.mark.parametrize("target", ["replace", "fsync"])
def test_failed_write_keeps_previous_content(
    store: BlobStore, root: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    store.put("p/doc", b"old content")
    monkeypatch.setattr(os, target, _boom)
    with pytest.raises(OSError, match="simulated crash"):
        store.put("p/doc", b"new content that never lands")
    monkeypatch.undo()
    assert store.get("p/doc") == b"old content"
    assert _temp_files(root) == []
    assert [blob.key for blob in store.list("p")] == ["doc"]


def test_failed_first_write_leaves_nothing(
    store: BlobStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "replace", _boom)
    with pytest.raises(OSError):
        store.put("p/new", b"data")
    monkeypatch.undo()
    assert not store.exists("p/new")
    assert _temp_files(root) == []
    assert store.list("p") == []


def test_list_hides_temp_files_left_by_a_hard_crash(store: BlobStore, root: Path) -> None:
    store.put("p/doc", b"x")
    (root / "p" / ".tmp-abc123").write_bytes(b"half written")
    (root / "p" / "sub").mkdir()
    (root / "p" / "sub" / ".tmp-zzz").write_bytes(b"half written")
    assert [blob.key for blob in store.list("p")] == ["doc"]


# ----------------------------------------------------------------------------- symlinks


def test_key_through_symlinked_directory_is_refused(
    store: BlobStore, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (root / "link").symlink_to(outside, target_is_directory=True)

    with pytest.raises(InvalidInput, match="symlink"):
        store.get("link/secret")
    with pytest.raises(InvalidInput):
        store.put("link/planted", b"x")
    with pytest.raises(InvalidInput):
        store.exists("link/secret")
    with pytest.raises(InvalidInput):
        store.delete("link/secret")
    with pytest.raises(InvalidInput):
        store.list("link")
    with pytest.raises(InvalidInput):
        store.delete_prefix("link")
    assert sorted(os.listdir(outside)) == ["secret"]


def test_symlinked_file_is_refused_and_not_listed(
    store: BlobStore, root: Path, tmp_path: Path
) -> None:
    target = tmp_path / "passwd"
    target.write_bytes(b"root:x:0:0")
    store.put("p/real", b"x")
    (root / "p" / "leak").symlink_to(target)
    with pytest.raises(InvalidInput):
        store.get("p/leak")
    assert [blob.key for blob in store.list("p")] == ["real"]


def test_symlinked_directory_contents_are_not_listed(
    store: BlobStore, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    store.put("p/real", b"x")
    (root / "p" / "linkdir").symlink_to(outside, target_is_directory=True)
    assert [blob.key for blob in store.list("p")] == ["real"]
    store.delete_prefix("p")
    assert (outside / "secret").read_bytes() == b"s"


@pytest.mark.parametrize("key", ["../escape", "a/../../escape", "a/../b"])
def test_dot_dot_keys_are_refused(store: BlobStore, tmp_path: Path, key: str) -> None:
    with pytest.raises(InvalidInput):
        store.put(key, b"x")
    assert not (tmp_path / "escape").exists()


def test_root_given_through_a_symlink_works(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    alias = tmp_path / "alias"
    alias.symlink_to(real, target_is_directory=True)
    store = BlobStore(str(alias))
    store.put("a/b", b"x")
    assert store.get("a/b") == b"x"
    assert (real / "a" / "b").read_bytes() == b"x"
