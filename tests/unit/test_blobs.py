"""BlobStore's contract, over a local directory and over S3 (moto's S3-compatible
HTTP server, started once for this module: tests/support/s3_server.py). What only
a filesystem has (atomic renames, symlinks) is tested on the local store only."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from nbfleet.model.errors import Conflict, InvalidInput, NotFound, Unavailable
from nbfleet.storage.blobs import BlobStore, BlobStoreUnusable
from nbfleet.storage.s3 import MAX_KEY_BYTES
from tests.support.cluster import free_port
from tests.support.s3_server import S3Server, aws_env, s3_server

BUCKET = "nbfleet-contract"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "blobs"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The server (recording requests) and a bucket; this process's AWS_* variables
    point at it."""
    with s3_server(tmp_path_factory.mktemp("moto"), record=True) as server, aws_env(server):
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, root: Path) -> BlobStore:
    """Each test's own store: a directory, or a fresh prefix of the bucket."""
    if request.param == "local":
        return BlobStore(str(root))
    request.getfixturevalue("s3")
    return BlobStore(f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def local(root: Path) -> BlobStore:
    return BlobStore(str(root))


@pytest.fixture
def on_s3(s3: S3Server) -> BlobStore:
    """For what only S3 has (presigned URLs, requests, placeholders): a fresh prefix."""
    return BlobStore(f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}")


def _prefix(store: BlobStore) -> str:
    """The store's prefix in the bucket."""
    return store.root.split("/", 1)[1]


def _temp_files(root: Path) -> list[str]:
    return [name for _, _, files in os.walk(root) for name in files if name.startswith(".tmp-")]


def test_creates_root(root: Path, local: BlobStore) -> None:
    assert root.is_dir()
    assert local.local


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


def test_delete_many_deletes_those_and_ignores_the_missing(store: BlobStore) -> None:
    for key in ["c/a", "c/b", "c/keep", "d/a"]:
        store.put(key, b"x")
    store.delete_many(["c/a", "c/b", "c/never"])
    assert [blob.key for blob in store.list("c")] == ["keep"]
    assert store.exists("d/a")
    store.delete_many([])
    with pytest.raises(InvalidInput):
        store.delete_many(["c/../d/a"])
    assert store.exists("d/a")


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


@pytest.mark.parametrize("key", ["../escape", "a/../../escape", "a/../b", "./a", "a//b",
                                 "/abs", "a/", ""])
def test_keys_that_are_not_plain_relative_paths_are_refused(
        request: pytest.FixtureRequest, store: BlobStore, tmp_path: Path, key: str) -> None:
    """An object store resolves nothing: "../escape" would be a key beside this
    store's prefix, in another tenant's or store's namespace."""
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key),
                 lambda: store.exists(key), lambda: store.delete(key)):
        with pytest.raises(InvalidInput):
            call()
    assert not (tmp_path / "escape").exists()
    if store.s3:  # nothing in this store, nor beside it in the bucket
        server: S3Server = request.getfixturevalue("s3")
        assert server.keys(BUCKET, _prefix(store)) == []
        assert all(key.startswith("t-") for key in server.keys(BUCKET))


def test_put_file_and_get_file_round_trip(store: BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(300_000))
    store.put_file("p/big.bin", str(source))
    assert store.get("p/big.bin") == source.read_bytes()
    copy = tmp_path / "copy.bin"
    store.get_file("p/big.bin", str(copy))
    assert copy.read_bytes() == source.read_bytes()
    assert source.exists()  # copied, not moved
    with pytest.raises(NotFound):
        store.get_file("p/missing", str(tmp_path / "never"))


def test_a_file_cannot_be_the_parent_of_another(store: BlobStore, tmp_path: Path) -> None:
    """With ``check_tree`` (keys from users): an object store refuses it as a disk does."""
    store.put("t/a.txt", b"a file")
    source = tmp_path / "f"
    source.write_bytes(b"x")
    for key in ("t/a.txt/child", "t/a.txt/deeper/child"):
        with pytest.raises(Conflict, match="a parent of this path is a file"):
            store.put(key, b"x", check_tree=True)
        with pytest.raises(Conflict, match="a parent of this path is a file"):
            store.put_file(key, str(source), check_tree=True)
    assert [blob.key for blob in store.list("t")] == ["a.txt"]


def test_a_directory_cannot_become_a_file(store: BlobStore, tmp_path: Path) -> None:
    store.put("t/dir/inner", b"inner")
    source = tmp_path / "f"
    source.write_bytes(b"x")
    with pytest.raises(Conflict, match="a directory of this name exists"):
        store.put("t/dir", b"x", check_tree=True)
    with pytest.raises(Conflict, match="a directory of this name exists"):
        store.put_file("t/dir", str(source), check_tree=True)
    assert [blob.key for blob in store.list("t")] == ["dir/inner"]


def test_names_with_a_query_string_are_names(
        request: pytest.FixtureRequest, store: BlobStore, tmp_path: Path) -> None:
    """s3fs reads ``?versionId=`` in a path as an object's version and cuts the key
    there: a user's ``notes.txt?versionId=1`` must not overwrite ``notes.txt``."""
    name = "notes.txt?versionId=1"
    store.put("q/notes.txt", b"plain")
    store.put(f"q/{name}", b"other")
    source = tmp_path / "f"
    source.write_bytes(b"from a file")
    store.put_file(f"q/sub/{name}", str(source))
    assert store.get("q/notes.txt") == b"plain"
    assert store.get(f"q/{name}") == b"other"
    assert store.exists(f"q/{name}") and store.exists(f"q/sub/{name}")
    assert not store.exists("q/sub/notes.txt")
    assert [blob.key for blob in store.list("q")] == ["notes.txt", name, f"sub/{name}"]
    copy = tmp_path / "copy"
    store.get_file(f"q/sub/{name}", str(copy))
    assert copy.read_bytes() == b"from a file"
    if store.s3:
        server: S3Server = request.getfixturevalue("s3")
        prefix = _prefix(store)
        assert server.keys(BUCKET, prefix) == [f"{prefix}/q/{key}" for key in (
            "notes.txt", name, f"sub/{name}")]
        assert httpx.get(store.signed_url(f"q/{name}", 60)).content == b"other"
    store.delete(f"q/{name}")
    assert store.get("q/notes.txt") == b"plain"
    assert not store.exists(f"q/{name}")
    store.delete_prefix(f"q/sub/{name}")
    assert [blob.key for blob in store.list("q")] == ["notes.txt"]


def test_list_of_a_key_that_is_a_blob_is_empty(store: BlobStore) -> None:
    store.put("p/f", b"x")
    assert store.list("p/f") == []


def test_names_that_look_like_globs_are_names(store: BlobStore) -> None:
    """fsspec expands ``*`` and ``[...]`` in some calls: a user's file named so must
    delete itself, not its neighbours."""
    for key in ("g/a*", "g/[ab]", "g/ab", "g/b", "h/x"):
        store.put(key, b"x")
    store.delete("g/a*")
    store.delete("g/[ab]")
    assert [blob.key for blob in store.list("g")] == ["ab", "b"]
    store.put("g/a*/in", b"x")
    store.delete_prefix("g/a*")
    assert [blob.key for blob in store.list("g")] == ["ab", "b"]
    store.delete_prefix("g")
    assert store.list("g") == []
    assert store.exists("h/x")


def test_another_writer_is_seen_at_once(store: BlobStore) -> None:
    """The control plane and every agent share the store: what one of them writes
    or deletes, another sees at once, even right after listing the same place
    (a cached listing would answer from before)."""
    other = BlobStore(store.url)  # another process's store
    store.put("w/old", b"1")
    assert [blob.key for blob in store.list("w")] == ["old"]
    assert store.exists("w/old")
    other.put("w/new", b"2")
    other.delete("w/old")
    assert store.exists("w/new")
    assert not store.exists("w/old")
    assert store.get("w/new") == b"2"
    with pytest.raises(NotFound):
        store.delete("w/old")
    assert [blob.key for blob in store.list("w")] == ["new"]
    other.delete_prefix("w")
    assert not store.exists("w/new")
    assert store.list("w") == []


# ------------------------------------------------------------------------- S3 only


def test_presigned_urls_download_bytes_as_attachments(
        on_s3: BlobStore, s3: S3Server, tmp_path: Path) -> None:
    """A job's report.html must download, never render as a page of the endpoint's
    origin, whatever type the object was stored with (s3fs guesses one from the
    local file's name; here also one stored as text/html behind nbfleet's back)."""
    page = tmp_path / "report.html"
    page.write_bytes(b"<script>alert(1)</script>")
    on_s3.put_file("r/report.html", str(page))
    s3.client().put_object(Bucket=BUCKET, Key=f"{_prefix(on_s3)}/r/raw.svg",
                           Body=b"<svg onload='alert(1)'/>", ContentType="image/svg+xml")
    for key, filename, disposition in (
            ("r/report.html", None, 'attachment; filename="report.html"'),
            ("r/raw.svg", 'a "b"\\é.svg',
             'attachment; filename="a \\"b\\"\\\\_.svg"; '
             "filename*=UTF-8''a%20%22b%22%5C%C3%A9.svg")):
        response = httpx.get(on_s3.signed_url(key, 60, filename=filename))
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/octet-stream"
        assert response.headers["content-disposition"] == disposition
        assert response.content.startswith(b"<")


def test_writes_check_the_tree_only_when_asked(
        on_s3: BlobStore, s3: S3Server, tmp_path: Path) -> None:
    """Keys the platform makes (logs, snapshots) cost one PUT; keys from users one
    HEAD per parent and a one-key listing besides."""
    source = tmp_path / "f"
    source.write_bytes(b"x")
    with s3.requests() as plain:
        on_s3.put("a/b/c/d", b"x")
        on_s3.put_file("a/b/c/e", str(source))
    assert [method for method, _ in plain] == ["PUT", "PUT"]
    with s3.requests() as checked:
        on_s3.put("a/b/c/f", b"x", check_tree=True)
    assert sorted(method for method, _ in checked) == ["GET", "HEAD", "HEAD", "HEAD", "PUT"]


def test_the_check_lists_the_prefix_not_the_bucket(on_s3: BlobStore, s3: S3Server) -> None:
    """HeadBucket needs s3:ListBucket on the whole bucket, which a policy scoped to
    the prefix does not grant: the check lists one key of the prefix."""
    with s3.requests() as seen:
        on_s3.check()
    ((method, url),) = seen
    query = parse_qs(urlparse(url).query)
    assert method == "GET" and urlparse(url).path == f"/{BUCKET}"
    assert query["prefix"] == [f"{_prefix(on_s3)}/"] and query["max-keys"] == ["1"]
    with pytest.raises(BlobStoreUnusable, match="no such bucket: nbfleet-nonexistent"):
        BlobStore("s3://nbfleet-nonexistent/x").check()


def test_the_check_fails_fast_on_an_unreachable_endpoint(
        s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """One attempt, a short connect timeout: not botocore's and s3fs's retries."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    store = BlobStore(f"s3://{BUCKET}/x")
    started = time.monotonic()
    with pytest.raises(BlobStoreUnusable, match="EndpointConnectionError"):
        store.check()
    assert time.monotonic() - started < 3


def test_a_403_where_a_404_was_expected_is_a_clear_503(on_s3: BlobStore) -> None:
    """S3 answers 403 to a HEAD of a missing key for credentials without
    s3:ListBucket: the deployment's to fix, said so, not a 500."""
    on_s3.put("p/a", b"x")

    def forbidden(**_kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return (SimpleNamespace(status_code=403, headers={}),
                {"Error": {"Code": "403", "Message": "Forbidden"},
                 "ResponseMetadata": {"HTTPStatusCode": 403}})

    backend = on_s3._s3
    assert backend is not None
    backend.fs.s3.meta.events.register("before-call.s3.HeadObject", forbidden)
    for call in (lambda: on_s3.exists("p/missing"), lambda: on_s3.delete("p/missing"),
                 lambda: on_s3.put("p/a/b", b"x", check_tree=True)):
        with pytest.raises(Unavailable, match="s3:ListBucket") as refused:
            call()
        assert refused.value.status == 503


def test_keys_longer_than_s3_allows_are_refused(on_s3: BlobStore, tmp_path: Path) -> None:
    """1024 bytes of UTF-8, the store's prefix included: refused as the caller's
    input (422), not S3's KeyTooLongError (a 500); such a key names nothing."""
    room = MAX_KEY_BYTES - len(_prefix(on_s3).encode()) - len("/k/")
    fits, too_long = "k/" + "é" * (room // 2), "k/" + "é" * (room // 2) + "x" * (room % 2 + 1)
    assert len(too_long) < MAX_KEY_BYTES  # characters; the bytes are what count
    on_s3.put(fits, b"x")
    assert on_s3.get(fits) == b"x"
    source = tmp_path / "f"
    source.write_bytes(b"x")
    for write in (lambda: on_s3.put(too_long, b"x"),
                  lambda: on_s3.put_file(too_long, str(source))):
        with pytest.raises(InvalidInput, match="1024 bytes"):
            write()
    assert not on_s3.exists(too_long)
    with pytest.raises(NotFound):
        on_s3.get(too_long)
    assert [blob.key for blob in on_s3.list("k")] == [fits[2:]]


def test_list_skips_directory_placeholders_and_keeps_tmp_names(
        on_s3: BlobStore, s3: S3Server) -> None:
    """A key ending in ``/`` is a console's "folder", not a file; ``.tmp-`` names
    are the local store's half-written files only: on S3 they are a user's."""
    on_s3.put("p/.tmp-draft", b"mine")
    on_s3.put("p/a", b"x")
    for placeholder in ("p/", "p/dir/"):
        s3.client().put_object(Bucket=BUCKET, Key=f"{_prefix(on_s3)}/{placeholder}", Body=b"")
    assert [blob.key for blob in on_s3.list("p")] == [".tmp-draft", "a"]
    assert on_s3.get("p/.tmp-draft") == b"mine"


# --------------------------------------------------------------------------- atomicity


def _boom(*_args: object, **_kwargs: object) -> None:
    raise OSError("simulated crash")


@pytest.mark.parametrize("target", ["replace", "fsync"])
def test_failed_write_keeps_previous_content(
    local: BlobStore, root: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    local.put("p/doc", b"old content")
    monkeypatch.setattr(os, target, _boom)
    with pytest.raises(OSError, match="simulated crash"):
        local.put("p/doc", b"new content that never lands")
    monkeypatch.undo()
    assert local.get("p/doc") == b"old content"
    assert _temp_files(root) == []
    assert [blob.key for blob in local.list("p")] == ["doc"]


def test_failed_first_write_leaves_nothing(
    local: BlobStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "replace", _boom)
    with pytest.raises(OSError):
        local.put("p/new", b"data")
    monkeypatch.undo()
    assert not local.exists("p/new")
    assert _temp_files(root) == []
    assert local.list("p") == []


def test_list_hides_temp_files_left_by_a_hard_crash(local: BlobStore, root: Path) -> None:
    local.put("p/doc", b"x")
    (root / "p" / ".tmp-abc123").write_bytes(b"half written")
    (root / "p" / "sub").mkdir()
    (root / "p" / "sub" / ".tmp-zzz").write_bytes(b"half written")
    assert [blob.key for blob in local.list("p")] == ["doc"]


# ----------------------------------------------------------------------------- symlinks


def test_key_through_symlinked_directory_is_refused(
    local: BlobStore, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (root / "link").symlink_to(outside, target_is_directory=True)

    with pytest.raises(InvalidInput, match="symlink"):
        local.get("link/secret")
    with pytest.raises(InvalidInput):
        local.put("link/planted", b"x")
    with pytest.raises(InvalidInput):
        local.exists("link/secret")
    with pytest.raises(InvalidInput):
        local.delete("link/secret")
    with pytest.raises(InvalidInput):
        local.list("link")
    with pytest.raises(InvalidInput):
        local.delete_prefix("link")
    assert sorted(os.listdir(outside)) == ["secret"]


def test_symlinked_file_is_refused_and_not_listed(
    local: BlobStore, root: Path, tmp_path: Path
) -> None:
    target = tmp_path / "passwd"
    target.write_bytes(b"root:x:0:0")
    local.put("p/real", b"x")
    (root / "p" / "leak").symlink_to(target)
    with pytest.raises(InvalidInput):
        local.get("p/leak")
    assert [blob.key for blob in local.list("p")] == ["real"]


def test_symlinked_directory_contents_are_not_listed(
    local: BlobStore, root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    local.put("p/real", b"x")
    (root / "p" / "linkdir").symlink_to(outside, target_is_directory=True)
    assert [blob.key for blob in local.list("p")] == ["real"]
    local.delete_prefix("p")
    assert (outside / "secret").read_bytes() == b"s"


def test_root_given_through_a_symlink_works(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    alias = tmp_path / "alias"
    alias.symlink_to(real, target_is_directory=True)
    store = BlobStore(str(alias))
    store.put("a/b", b"x")
    assert store.get("a/b") == b"x"
    assert (real / "a" / "b").read_bytes() == b"x"
