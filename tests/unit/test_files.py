"""WorkspaceFiles: workspace files in the blob store, notebooks validated."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from nbfleet.model.errors import InvalidInput, NotFound
from nbfleet.storage import files as files_module
from nbfleet.storage.blobs import BlobStore
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
    with pytest.raises(InvalidInput, match="larger"):
        files.put(WS, "big.bin", b"x" * 11)
    with pytest.raises(NotFound):
        files.get(WS, "big.bin")


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
