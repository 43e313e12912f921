"""WorkspaceFiles: workspace files in the blob store, notebooks validated."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from nbfleet.model.errors import Conflict, ContentTooLarge, InvalidInput, NotFound
from nbfleet.storage import files as files_module
from nbfleet.storage.blobs import STAGING, BlobStore
from nbfleet.storage.files import WorkspaceFiles, files_prefix

WS = "ws_01"
OTHER = "ws_02"


@pytest.fixture
def files(tmp_path: Path) -> WorkspaceFiles:
    return WorkspaceFiles(BlobStore(str(tmp_path / "blobs")))


def _notebook(source: str = "1 + 1") -> bytes:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    return nbformat.writes(nb).encode()


def _mutated(change: object) -> bytes:
    data = json.loads(_notebook())
    change(data)  # type: ignore[operator]
    return json.dumps(data).encode()


def _bad_cell_type(nb: dict) -> None:
    nb["cells"][0]["cell_type"] = "bogus"


def _drop_source(nb: dict) -> None:
    del nb["cells"][0]["source"]


def _drop_cells(nb: dict) -> None:
    del nb["cells"]


INVALID_NOTEBOOKS = {
    "not-json": b"{this is not json",
    "empty": b"",
    "not-utf8": b"\xff\xfe\x00",
    "json-list": b"[]",
    "empty-object": b"{}",
    "missing-cells": _mutated(_drop_cells),
    "bad-cell-type": _mutated(_bad_cell_type),
    "cell-without-source": _mutated(_drop_source),
}


def test_valid_notebook_round_trips(files: WorkspaceFiles) -> None:
    data = _notebook("print('hi')")
    assert files.put(WS, "nb/analysis.ipynb", data) == "nb/analysis.ipynb"
    stored = files.get(WS, "nb/analysis.ipynb")
    assert stored == data
    assert nbformat.reads(stored.decode(), as_version=4).cells[0].source == "print('hi')"


@pytest.mark.parametrize("name", sorted(INVALID_NOTEBOOKS))
def test_invalid_notebook_is_refused_and_not_stored(files: WorkspaceFiles, name: str) -> None:
    with pytest.raises(InvalidInput, match="not a valid notebook") as info:
        files.put(WS, "bad.ipynb", INVALID_NOTEBOOKS[name])
    assert info.value.extra["path"] == "bad.ipynb"
    with pytest.raises(NotFound):
        files.get(WS, "bad.ipynb")
    assert files.list(WS) == []


@pytest.mark.parametrize("name", sorted(INVALID_NOTEBOOKS))
def test_invalid_notebook_keeps_previous_version(files: WorkspaceFiles, name: str) -> None:
    good = _notebook("x = 1")
    files.put(WS, "keep.ipynb", good)
    with pytest.raises(InvalidInput):
        files.put(WS, "keep.ipynb", INVALID_NOTEBOOKS[name])
    assert files.get(WS, "keep.ipynb") == good


def test_other_files_are_not_validated(files: WorkspaceFiles) -> None:
    files.put(WS, "notes.txt", b"{not json")
    files.put(WS, "data.json", b"\xff\xfe")
    assert files.get(WS, "notes.txt") == b"{not json"
    assert files.get(WS, "data.json") == b"\xff\xfe"


def test_oversized_file_is_refused(files: WorkspaceFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files_module, "MAX_FILE_BYTES", 10)
    files.put(WS, "ok.bin", b"x" * 10)
    with pytest.raises(ContentTooLarge, match="larger") as info:
        files.put(WS, "big.bin", b"x" * 11)
    assert info.value.status == 413
    with pytest.raises(NotFound):
        files.get(WS, "big.bin")


def _staged(files: WorkspaceFiles) -> list[str]:
    staging = Path(files.blobs.root) / STAGING
    return sorted(p.name for p in staging.iterdir()) if staging.exists() else []


def test_upload_in_pieces_becomes_the_file(files: WorkspaceFiles) -> None:
    with files.upload(WS, "dir/data.bin") as upload:
        for piece in (b"abc", b"", b"defg"):
            upload.write(piece)
        assert files.commit(WS, "dir/data.bin", upload) == "dir/data.bin"
        # The upload still reads what it wrote, after the rename into place.
        assert upload.read_chunk(0) == b"abcdefg"
        assert upload.read_chunk(3, 2) == b"de"
    assert files.get(WS, "dir/data.bin") == b"abcdefg"
    assert _staged(files) == []


def test_upload_past_the_limit_is_refused_and_leaves_nothing(
        files: WorkspaceFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files_module, "MAX_FILE_BYTES", 10)
    files.put(WS, "big.bin", b"old")
    with files.upload(WS, "new/dir/big.bin") as upload:
        upload.write(b"x" * 6)
        with pytest.raises(ContentTooLarge) as info:
            upload.write(b"x" * 5)
        assert info.value.status == 413
    with files.upload(WS, "big.bin") as upload, pytest.raises(ContentTooLarge):
        upload.write(b"y" * 11)
    assert _staged(files) == []
    assert [blob.key for blob in files.list(WS)] == ["big.bin"]
    assert files.get(WS, "big.bin") == b"old"
    # Not even the directory of the refused file was made.
    assert not (Path(files.blobs.root) / files_prefix(WS) / "new").exists()


def test_an_upload_closed_before_commit_leaves_nothing(files: WorkspaceFiles) -> None:
    with files.upload(WS, "gone.txt") as upload:
        upload.write(b"half")
    assert _staged(files) == []
    with pytest.raises(NotFound):
        files.get(WS, "gone.txt")


def test_uploaded_notebooks_are_validated(files: WorkspaceFiles) -> None:
    good = _notebook("x = 1")
    files.put(WS, "keep.ipynb", good)
    with files.upload(WS, "keep.ipynb") as upload:
        upload.write(b"{not a notebook")
        with pytest.raises(InvalidInput, match="not a valid notebook"):
            files.commit(WS, "keep.ipynb", upload)
    assert files.get(WS, "keep.ipynb") == good
    assert _staged(files) == []


def test_upload_refuses_a_bad_path_before_reading(files: WorkspaceFiles) -> None:
    with pytest.raises(InvalidInput):
        files.upload(WS, "../escape")
    assert _staged(files) == []


def test_a_file_cannot_be_the_parent_of_another(files: WorkspaceFiles) -> None:
    files.put(WS, "ok.txt", b"a file")
    for path in ("ok.txt/child.txt", "ok.txt/deeper/child.txt"):
        with pytest.raises(Conflict, match="parent of this path is a file") as info:
            files.put(WS, path, b"x")
        assert info.value.status == 409
        assert info.value.detail.startswith(f"{path}:")  # the workspace's path, not a key
        with files.upload(WS, path) as upload:
            upload.write(b"x")
            with pytest.raises(Conflict):
                files.commit(WS, path, upload)
        with pytest.raises(NotFound):
            files.get(WS, path)
    assert files.get(WS, "ok.txt") == b"a file"
    assert _staged(files) == []


def test_a_directory_cannot_be_overwritten_by_a_file(files: WorkspaceFiles) -> None:
    files.put(WS, "dir/inner.txt", b"inner")
    with pytest.raises(Conflict, match="a directory of this name exists"):
        files.put(WS, "dir", b"x")
    with files.upload(WS, "dir") as upload:
        upload.write(b"x")
        with pytest.raises(Conflict):
            files.commit(WS, "dir", upload)
    assert files.get(WS, "dir/inner.txt") == b"inner"
    assert [blob.key for blob in files.list(WS)] == ["dir/inner.txt"]
    with pytest.raises(NotFound):
        files.get(WS, "dir")
    assert _staged(files) == []


def test_names_longer_than_the_filesystem_allows_are_refused(files: WorkspaceFiles) -> None:
    files.put(WS, "x" * 255, b"longest name")
    assert files.get(WS, "x" * 255) == b"longest name"
    for path in ("x" * 256, "dir/" + "é" * 128):
        with pytest.raises(InvalidInput, match="at most 255 bytes"):
            files.put(WS, path, b"x")
        with pytest.raises(InvalidInput):
            files.get(WS, path)


def test_colons_are_ordinary_characters(files: WorkspaceFiles) -> None:
    files.put(WS, "a:b", b"colon")
    files.put(WS, "C:/x.txt", b"drive-like")
    assert files.get(WS, "a:b") == b"colon"
    assert sorted(blob.key for blob in files.list(WS)) == ["C:/x.txt", "a:b"]


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../b", "a//b", "a\\b", ""])
def test_path_traversal_is_refused(files: WorkspaceFiles, tmp_path: Path, path: str) -> None:
    with pytest.raises(InvalidInput):
        files.put(WS, path, b"x")
    with pytest.raises(InvalidInput):
        files.get(WS, path)
    with pytest.raises(InvalidInput):
        files.delete(WS, path)
    assert not (tmp_path / "escape").exists()
    assert files.list(WS) == []


def test_list_is_relative_to_the_workspace(files: WorkspaceFiles) -> None:
    files.put(WS, "b.txt", b"b")
    files.put(WS, "dir/a.txt", b"a")
    files.put(OTHER, "c.txt", b"c")
    assert [blob.key for blob in files.list(WS)] == ["b.txt", "dir/a.txt"]
    assert [blob.key for blob in files.list(OTHER)] == ["c.txt"]


def test_workspaces_are_isolated(files: WorkspaceFiles) -> None:
    files.put(WS, "same.txt", b"mine")
    files.put(OTHER, "same.txt", b"theirs")
    assert files.get(WS, "same.txt") == b"mine"
    assert files.get(OTHER, "same.txt") == b"theirs"


def test_delete_one_file(files: WorkspaceFiles) -> None:
    files.put(WS, "a.txt", b"a")
    files.put(WS, "b.txt", b"b")
    files.delete(WS, "a.txt")
    assert [blob.key for blob in files.list(WS)] == ["b.txt"]
    with pytest.raises(NotFound):
        files.delete(WS, "a.txt")


def test_delete_all_removes_one_workspace_only(files: WorkspaceFiles) -> None:
    files.put(WS, "a.txt", b"a")
    files.put(WS, "deep/nested/nb.ipynb", _notebook())
    files.put(OTHER, "a.txt", b"other")
    files.put("ws_010", "x.txt", b"prefix sibling")
    files.delete_all(WS)
    assert files.list(WS) == []
    with pytest.raises(NotFound):
        files.get(WS, "a.txt")
    assert files.get(OTHER, "a.txt") == b"other"
    assert files.get("ws_010", "x.txt") == b"prefix sibling"
    assert not files.blobs.exists(f"{files_prefix(WS)}/a.txt")


def test_delete_all_of_empty_workspace_is_a_no_op(files: WorkspaceFiles) -> None:
    files.put(OTHER, "a.txt", b"a")
    files.delete_all(WS)
    assert files.get(OTHER, "a.txt") == b"a"
