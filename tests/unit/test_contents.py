"""Jupyter's Contents API models over the blob store (what JupyterLab saves through)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from nbfleet.model.errors import Conflict, InvalidInput, NotFound
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.contents import Change, WorkspaceContents
from nbfleet.storage.files import WorkspaceFiles

pytestmark = pytest.mark.no_db

WS = "ws_1"
NOTEBOOK = {"cells": [{"cell_type": "code", "source": "x = 1", "metadata": {},
                       "outputs": [], "execution_count": None, "id": "a1"}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def contents(tmp_path: Path) -> WorkspaceContents:
    return WorkspaceContents(WorkspaceFiles(BlobStore(str(tmp_path / "blobs"))))


def names(model: dict[str, object]) -> list[tuple[str, str]]:
    children = model["content"]
    assert isinstance(children, list)
    return sorted((c["name"], c["type"]) for c in children)


def test_a_saved_notebook_is_the_workspace_file_and_reads_back(contents: WorkspaceContents
                                                               ) -> None:
    model, created, changes = contents.save(WS, "nb/a.ipynb", {
        "type": "notebook", "format": "json", "content": NOTEBOOK})
    assert created and model["type"] == "notebook" and model["content"] is None
    assert changes == [Change("nb/a.ipynb", contents.files.get(WS, "nb/a.ipynb"))]
    got = contents.get(WS, "nb/a.ipynb")
    assert got["format"] == "json" and got["content"]["cells"][0]["source"] == "x = 1"
    assert contents.save(WS, "nb/a.ipynb", {"type": "notebook", "format": "json",
                                            "content": NOTEBOOK})[1] is False
    root = contents.get(WS, "")
    assert names(root) == [("nb", "directory")]
    assert names(contents.get(WS, "nb")) == [("a.ipynb", "notebook")]


def test_an_invalid_notebook_is_refused_and_the_saved_one_stays(contents: WorkspaceContents
                                                                ) -> None:
    contents.save(WS, "a.ipynb", {"type": "notebook", "format": "json", "content": NOTEBOOK})
    broken = {**NOTEBOOK, "cells": [{"cell_type": "nonsense"}]}
    with pytest.raises(InvalidInput, match="not a valid notebook"):
        contents.save(WS, "a.ipynb", {"type": "notebook", "format": "json", "content": broken})
    assert contents.get(WS, "a.ipynb")["content"]["cells"][0]["source"] == "x = 1"


def test_text_and_binary_files_round_trip(contents: WorkspaceContents) -> None:
    contents.save(WS, "notes.md", {"type": "file", "format": "text", "content": "héllo"})
    raw = bytes(range(256))
    contents.save(WS, "blob.bin", {"type": "file", "format": "base64",
                                   "content": base64.b64encode(raw).decode()})
    text = contents.get(WS, "notes.md")
    assert (text["format"], text["content"], text["mimetype"]) == ("text", "héllo",
                                                                     "text/markdown")
    binary = contents.get(WS, "blob.bin")
    assert binary["format"] == "base64" and base64.b64decode(binary["content"]) == raw
    with pytest.raises(InvalidInput, match="not UTF-8"):
        contents.get(WS, "blob.bin", as_format="text")
    with pytest.raises(InvalidInput, match="base64"):
        contents.save(WS, "x.bin", {"type": "file", "format": "base64", "content": "!!"})


def test_untitled_names_and_copies_follow_jupyters_rule(contents: WorkspaceContents) -> None:
    first, _ = contents.new_untitled(WS, "", "notebook", "")
    second, _ = contents.new_untitled(WS, "", "notebook", "")
    folder, _ = contents.new_untitled(WS, "", "directory", "")
    script, _ = contents.new_untitled(WS, "", "file", ".py")
    assert [first["path"], second["path"], folder["path"], script["path"]] == [
        "Untitled.ipynb", "Untitled1.ipynb", "Untitled Folder", "untitled.py"]
    copy, changes = contents.copy(WS, "Untitled.ipynb", "Untitled Folder")
    assert copy["path"] == "Untitled Folder/Untitled-Copy1.ipynb"
    assert changes[0].path == copy["path"]
    # An empty directory persists (a marker outside the files, never materialized).
    assert all(not blob.key.endswith(".dir") for blob in contents.files.list(WS))


def test_renames_move_files_and_whole_directories(contents: WorkspaceContents) -> None:
    contents.save(WS, "d/a.txt", {"type": "file", "format": "text", "content": "a"})
    contents.save(WS, "d/e/b.txt", {"type": "file", "format": "text", "content": "b"})
    model, changes = contents.rename(WS, "d", "moved")
    assert model["type"] == "directory"
    assert {c.path for c in changes if c.data is None} == {"d/a.txt", "d/e/b.txt"}
    assert contents.get(WS, "moved/e/b.txt")["content"] == "b"
    with pytest.raises(NotFound):
        contents.get(WS, "d")
    with pytest.raises(Conflict):
        contents.rename(WS, "moved/a.txt", "moved/e")
    with pytest.raises(InvalidInput, match="into itself"):
        contents.rename(WS, "moved", "moved/e/inner")


def test_delete_removes_a_directory_with_what_it_holds(contents: WorkspaceContents) -> None:
    contents.save(WS, "d/a.txt", {"type": "file", "format": "text", "content": "a"})
    contents.save(WS, "d/sub", {"type": "directory"})
    assert {c.path for c in contents.delete(WS, "d")} == {"d/a.txt"}
    assert names(contents.get(WS, "")) == []
    with pytest.raises(InvalidInput):
        contents.delete(WS, "")


def test_checkpoints_save_and_restore_a_version(contents: WorkspaceContents) -> None:
    contents.save(WS, "a.txt", {"type": "file", "format": "text", "content": "v1"})
    assert contents.checkpoints(WS, "a.txt") == []
    checkpoint = contents.create_checkpoint(WS, "a.txt")
    contents.save(WS, "a.txt", {"type": "file", "format": "text", "content": "v2"})
    assert [c["id"] for c in contents.checkpoints(WS, "a.txt")] == [checkpoint["id"]]
    restored = contents.restore_checkpoint(WS, "a.txt", checkpoint["id"])
    assert restored == [Change("a.txt", b"v1")]
    assert contents.get(WS, "a.txt")["content"] == "v1"
    with pytest.raises(NotFound):
        contents.restore_checkpoint(WS, "a.txt", "other")
    contents.delete_checkpoint(WS, "a.txt", checkpoint["id"])
    assert contents.checkpoints(WS, "a.txt") == []
    # Checkpoints are not workspace files: never listed, never synced to a runtime.
    assert [blob.key for blob in contents.files.list(WS)] == ["a.txt"]


def test_a_chunked_upload_becomes_one_file_at_its_last_chunk(contents: WorkspaceContents
                                                             ) -> None:
    def chunk(n: int, data: bytes) -> dict[str, object]:
        return {"type": "file", "format": "base64", "chunk": n,
                "content": base64.b64encode(data).decode()}

    assert contents.save(WS, "big.bin", chunk(1, b"ab"))[2] == []
    assert contents.save(WS, "big.bin", chunk(2, b"cd"))[2] == []
    with pytest.raises(NotFound):
        contents.get(WS, "big.bin")  # nothing visible before the last chunk
    model, _, changes = contents.save(WS, "big.bin", chunk(-1, b"ef"))
    assert changes == [Change("big.bin", b"abcdef")] and model["size"] == 6
    with pytest.raises(InvalidInput, match="without chunk 1"):
        contents.save(WS, "other.bin", chunk(3, b"x"))


def test_hidden_files_are_not_listed_but_stay(contents: WorkspaceContents) -> None:
    contents.save(WS, ".secret", {"type": "file", "format": "text", "content": "s"})
    contents.save(WS, "shown.txt", {"type": "file", "format": "text", "content": "s"})
    assert names(contents.get(WS, "")) == [("shown.txt", "file")]
    assert contents.get(WS, ".secret")["content"] == "s"


@pytest.mark.parametrize("path", ["../escape.txt", "a/../../b", "a//b", "a\\b", "x\x00y",
                                  "./a", "a/./b"])
def test_paths_that_leave_the_workspace_are_refused(contents: WorkspaceContents,
                                                    path: str) -> None:
    with pytest.raises(InvalidInput):
        contents.save(WS, path, {"type": "file", "format": "text", "content": "x"})
    with pytest.raises(InvalidInput):
        contents.get(WS, path)


@pytest.mark.parametrize("model", [
    {"type": "notebook", "format": "json", "content": "not a dict"},
    {"type": "file", "format": "text", "content": 3},
    {"type": "file", "format": "hex", "content": "00"},
    {"type": "symlink", "content": "/etc/passwd"},
    {"type": "file", "format": "base64", "content": "", "chunk": 0},
    {"type": "file", "format": "base64", "content": "", "chunk": True},
])
def test_malformed_models_get_a_clear_error(contents: WorkspaceContents,
                                            model: dict[str, object]) -> None:
    with pytest.raises(InvalidInput):
        contents.save(WS, "x", model)
    assert names(contents.get(WS, "")) == []


def test_a_notebook_is_written_as_nbformat_json(contents: WorkspaceContents) -> None:
    contents.save(WS, "a.ipynb", {"type": "notebook", "format": "json", "content": NOTEBOOK})
    on_disk = json.loads(contents.files.get(WS, "a.ipynb"))
    assert on_disk["nbformat"] == 4 and on_disk["cells"][0]["id"] == "a1"
