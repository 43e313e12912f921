"""Snapshots in the blob store: content-addressed, verified, never half-current."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.collect import Collected, collect, snapshot_keys
from nbfleet.storage.snapshots import (
    CorruptSnapshot,
    cas_key,
    download_state,
    pack_layer,
    restore_layer,
    store_layer,
    upload_state,
)

WS = "ws_test"


def write_state(directory: Path, blobs: dict[str, bytes]) -> list[str]:
    (directory / "blobs").mkdir(parents=True, exist_ok=True)
    digests = []
    for data in blobs.values():
        digest = hashlib.sha256(data).hexdigest()
        (directory / "blobs" / digest).write_bytes(data)
        digests.append(digest)
    manifest = {"format": 1, "values": {}, "blobs": sorted(digests)}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return digests


def test_round_trip_and_unchanged_blobs_are_not_uploaded_twice(tmp_path: Path) -> None:
    store = BlobStore(str(tmp_path / "store"))
    kernel_dir = tmp_path / "k1"
    big, small = os.urandom(300_000), b"x" * 10
    write_state(kernel_dir, {"big": big, "small": small})
    first = upload_state(store, WS, "k1", str(kernel_dir))
    assert first.bytes_written == first.bytes_total > 300_000

    second = upload_state(store, WS, "k1", str(kernel_dir))
    assert second.key != first.key  # a fresh key: the old snapshot stays valid
    assert second.bytes_written == len((kernel_dir / "manifest.json").read_bytes())

    target = tmp_path / "restore"
    size = download_state(store, WS, second.key, str(target))
    assert size == second.bytes_total
    assert (target / "blobs" / hashlib.sha256(big).hexdigest()).read_bytes() == big
    assert (target / "manifest.json").read_bytes() == (kernel_dir / "manifest.json").read_bytes()


def test_a_corrupt_blob_a_missing_blob_or_bad_json_is_refused(tmp_path: Path) -> None:
    store = BlobStore(str(tmp_path / "store"))
    kernel_dir = tmp_path / "k1"
    digest = write_state(kernel_dir, {"v": b"value" * 100})[0]
    key = upload_state(store, WS, "k1", str(kernel_dir)).key

    store.put(cas_key(WS, digest), b"tampered")
    with pytest.raises(CorruptSnapshot, match="does not match its hash"):
        download_state(store, WS, key, str(tmp_path / "a"))
    store.delete(cas_key(WS, digest))
    with pytest.raises(CorruptSnapshot, match="missing"):
        download_state(store, WS, key, str(tmp_path / "b"))
    store.put(key, b"{not json")
    with pytest.raises(CorruptSnapshot, match="not valid JSON"):
        download_state(store, WS, key, str(tmp_path / "c"))
    store.put(key, json.dumps({"blobs": ["../../etc/passwd"]}).encode())
    with pytest.raises(CorruptSnapshot, match="SHA-256"):
        download_state(store, WS, key, str(tmp_path / "d"))
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_another_workspaces_snapshot_key_is_refused(tmp_path: Path) -> None:
    store = BlobStore(str(tmp_path / "store"))
    kernel_dir = tmp_path / "k1"
    write_state(kernel_dir, {"v": b"1"})
    key = upload_state(store, "ws_other", "k1", str(kernel_dir)).key
    with pytest.raises(CorruptSnapshot, match="not this workspace's"):
        download_state(store, WS, key, str(tmp_path / "x"))


def make_layer(root: Path) -> None:
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "pkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    (root / "pkg-1.0.dist-info").mkdir()
    (root / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\n")


def test_layers_are_deterministic_skip_caches_and_round_trip(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_layer(a)
    make_layer(b)
    os.utime(b / "pkg" / "__init__.py", (1, 1))  # times do not change the layer
    assert pack_layer(str(a)) == pack_layer(str(b))
    assert pack_layer(str(tmp_path / "empty")) is None

    store = BlobStore(str(tmp_path / "store"))
    key = store_layer(store, WS, str(a))
    assert key is not None and store_layer(store, WS, str(b)) == key
    target = tmp_path / "restored"
    restore_layer(store, WS, key, str(target))
    assert (target / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert not (target / "pkg" / "__pycache__").exists()

    store.put(key, b"garbage")
    with pytest.raises(CorruptSnapshot):
        restore_layer(store, WS, key, str(tmp_path / "again"))


def test_a_staged_download_links_the_blobs_it_has_and_fetches_the_rest(tmp_path: Path) -> None:
    store = BlobStore(str(tmp_path / "store"))
    kernel_dir = tmp_path / "k1"
    write_state(kernel_dir, {"a": b"alpha" * 100})
    first = upload_state(store, WS, "k1", str(kernel_dir))
    staged = tmp_path / "staged-1"
    staged.mkdir()
    download_state(store, WS, first.key, str(staged))
    write_state(kernel_dir, {"a": b"alpha" * 100, "b": b"beta" * 100})
    second = upload_state(store, WS, "k1", str(kernel_dir))
    again = tmp_path / "staged-2"
    again.mkdir()
    download_state(store, WS, second.key, str(again), reuse=str(staged))
    (digest_a,) = [p.name for p in (staged / "blobs").iterdir()]
    assert os.path.samefile(staged / "blobs" / digest_a, again / "blobs" / digest_a)
    assert len(list((again / "blobs").iterdir())) == 2


def test_a_manifest_naming_a_path_for_a_blob_never_reaches_the_file_system(
        tmp_path: Path) -> None:
    """The kernel writes its manifest: a "digest" of ``../../x`` is refused before it
    is joined to any path (a staged download links blobs by name: this one would
    link ``tmp/outside`` as ``tmp/t1/t2/outside``)."""
    store = BlobStore(str(tmp_path / "store"))
    (tmp_path / "outside").write_text("secret")
    staged = tmp_path / "staged"
    (staged / "blobs").mkdir(parents=True)
    target = tmp_path / "t1" / "t2" / "target"
    target.mkdir(parents=True)
    key = f"workspaces/{WS}/snapshots/k1/evil.json"
    store.put(key, json.dumps({"format": 1, "values": {},
                               "blobs": ["../../outside"]}).encode())
    with pytest.raises(CorruptSnapshot, match="not a SHA-256 digest"):
        download_state(store, WS, key, str(target), reuse=str(staged))
    assert not (tmp_path / "t1" / "t2" / "outside").exists()


def _snapshot(store: BlobStore, tmp_path: Path, workspace: str, name: str,
              values: dict[str, bytes]) -> str:
    write_state(tmp_path / name, values)
    return upload_state(store, workspace, "k1", str(tmp_path / name)).key


def _stored(root: Path, workspace: str) -> set[str]:
    top = root / "workspaces" / workspace
    return {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()}


def test_collection_keeps_what_the_kept_snapshots_name_and_nothing_else(
        tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = BlobStore(str(root))
    a, b, c, d = (os.urandom(1000) for _ in range(4))
    first = _snapshot(store, tmp_path, WS, "s1", {"a": a, "b": b})
    previous = _snapshot(store, tmp_path, WS, "s2", {"a": a, "c": c})
    new = _snapshot(store, tmp_path, WS, "s3", {"a": a, "d": d})
    packages = tmp_path / "site"
    (packages / "pkg").mkdir(parents=True)
    (packages / "pkg" / "__init__.py").write_text("x = 1\n")
    layer = store_layer(store, WS, str(packages))
    assert layer is not None
    theirs = _snapshot(store, tmp_path, "ws_other", "o1", {"b": b})  # the same bytes
    others = _stored(root, "ws_other")

    first_size = (root / first).stat().st_size
    done = collect(store, WS, {previous, new, layer})
    assert done == Collected(manifests=1, blobs=1, bytes=first_size + len(b))
    assert not (root / first).exists()
    assert not (root / cas_key(WS, hashlib.sha256(b).hexdigest())).exists()
    for key in (previous, new):
        download_state(store, WS, key, str(tmp_path / f"check-{key[-9:]}"))
    restore_layer(store, WS, layer, str(tmp_path / "site-back"))
    assert _stored(root, "ws_other") == others  # another workspace is never touched
    download_state(store, "ws_other", theirs, str(tmp_path / "theirs"))

    # The next suspend: only the new snapshot is kept.
    again = collect(store, WS, {new})
    assert (again.manifests, again.blobs) == (1, 2)  # previous, c and the layer
    assert collect(store, WS, {new}) == Collected()
    download_state(store, WS, new, str(tmp_path / "final"))


def test_collection_deletes_nothing_when_a_kept_manifest_cannot_be_read(
        tmp_path: Path) -> None:
    """The snapshot is broken already: what is left may be all there is to mend it."""
    root = tmp_path / "store"
    store = BlobStore(str(root))
    kept = _snapshot(store, tmp_path, WS, "s1", {"a": b"a" * 100})
    _snapshot(store, tmp_path, WS, "s2", {"b": b"b" * 100})
    before = _stored(root, WS)
    missing = kept.replace(".json", "0.json")
    with pytest.raises(CorruptSnapshot, match="missing"):
        collect(store, WS, {kept, missing})
    (root / kept).write_text("{not json")
    with pytest.raises(CorruptSnapshot, match="not valid JSON"):
        collect(store, WS, {kept})
    assert _stored(root, WS) == before


def test_collection_refuses_another_workspaces_keys(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = BlobStore(str(root))
    mine = _snapshot(store, tmp_path, WS, "s1", {"a": b"a" * 100})
    theirs = _snapshot(store, tmp_path, "ws_other", "o1", {"a": b"a" * 100})
    before = _stored(root, WS)
    with pytest.raises(ValueError):
        collect(store, WS, {mine, theirs})
    with pytest.raises(ValueError):
        collect(store, WS, {mine, "workspaces/ws_test/files/notes.txt"})
    assert _stored(root, WS) == before


def test_the_keys_a_workspace_snapshot_names() -> None:
    record = {"kernels": {"k1": {"key": "m1", "cell": 3}, "k2": {"cell": 1}},
              "packages": "layer", "restarted": {"k3": {"at": "now"}}}
    assert snapshot_keys(record) == {"m1", "layer"}
    assert snapshot_keys({"kernels": {}, "packages": None}) == set()
    assert snapshot_keys(None) == set()
