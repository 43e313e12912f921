"""Jupyter's Contents API models over a workspace's files in the blob store.

JupyterLab saves, lists, renames and checkpoints through these models; the blob
store stays the only truth, so a save in Lab is a save of the workspace. The
directory tree is derived from the file keys; an empty directory is a marker blob
kept outside the files (``dirs/``), so it is never materialized into a runtime.
Checkpoints (one per file, as jupyter_server keeps by default) live under
``checkpoints/``. Every key written here holds a user's path, so it is written with
``check_tree`` (an object store refuses a file under a file, as a disk does).
Every function here does blocking I/O: call it in a thread.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import mimetypes
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nbfleet.model.errors import Conflict, InvalidInput, NotFound
from nbfleet.storage.blobs import BlobInfo
from nbfleet.storage.files import MAX_FILE_BYTES, WorkspaceFiles, workspace_prefix
from nbfleet.storage.paths import confine

CHECKPOINT_ID = "checkpoint"
_MARKER = ".dir"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Change:
    """A file a live runtime must mirror: new bytes, or ``None`` for a deletion."""

    path: str
    data: bytes | None


def clean(path: str) -> str:
    """A Contents API path ('' is the root) as a confined relative path."""
    path = path.strip("/")
    return confine(path) if path else ""


def _time(moment: datetime | None) -> str:
    return (moment or _EPOCH).isoformat().replace("+00:00", "Z")


def _is_hidden(path: str) -> bool:
    return any(part.startswith(".") for part in path.split("/"))


class WorkspaceContents:
    def __init__(self, files: WorkspaceFiles) -> None:
        self.files = files
        self.blobs = files.blobs

    # -- keys ------------------------------------------------------------------
    def _dirs_prefix(self, workspace_id: str) -> str:
        return f"{workspace_prefix(workspace_id)}/dirs"

    def _checkpoint_key(self, workspace_id: str, path: str) -> str:
        return f"{workspace_prefix(workspace_id)}/checkpoints/{confine(path)}"

    def _upload_key(self, workspace_id: str, path: str) -> str:
        return f"{workspace_prefix(workspace_id)}/uploads/{confine(path)}"

    def _discard(self, key: str) -> None:
        with contextlib.suppress(NotFound):
            self.blobs.delete(key)

    # -- the tree --------------------------------------------------------------
    def _tree(self, workspace_id: str) -> tuple[dict[str, BlobInfo], set[str]]:
        """Every file by path, and every directory (explicit or implied)."""
        files = {blob.key: blob for blob in self.files.list(workspace_id)}
        dirs = {""}
        for blob in self.blobs.list(self._dirs_prefix(workspace_id)):
            if blob.key.endswith("/" + _MARKER):
                dirs.add(blob.key[: -len(_MARKER) - 1])
        for path in list(files) + list(dirs):
            parent = posixpath.dirname(path)
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = posixpath.dirname(parent)
        return files, dirs

    def _file_model(self, path: str, blob: BlobInfo, as_type: str | None = None) -> dict[str, Any]:
        kind = as_type or ("notebook" if path.endswith(".ipynb") else "file")
        mimetype = None if kind == "notebook" else (
            mimetypes.guess_type(path)[0] or "application/octet-stream")
        return {"name": posixpath.basename(path), "path": path, "type": kind,
                "writable": True, "created": _time(blob.modified),
                "last_modified": _time(blob.modified), "size": blob.size,
                "mimetype": mimetype, "content": None, "format": None,
                "hash": None, "hash_algorithm": None}

    @staticmethod
    def _dir_model(path: str, modified: datetime | None = None) -> dict[str, Any]:
        return {"name": posixpath.basename(path), "path": path, "type": "directory",
                "writable": True, "created": _time(modified), "last_modified": _time(modified),
                "size": None, "mimetype": None, "content": None, "format": None,
                "hash": None, "hash_algorithm": None}

    def get(self, workspace_id: str, raw_path: str, content: bool = True,
            as_type: str | None = None, as_format: str | None = None) -> dict[str, Any]:
        path = clean(raw_path)
        files, dirs = self._tree(workspace_id)
        if path in files and as_type != "directory":
            model = self._file_model(path, files[path], as_type)
            if content:
                self._fill(workspace_id, model, as_format)
            return model
        if path in dirs and as_type in (None, "directory"):
            model = self._dir_model(path)
            if content:
                model["format"] = "json"
                model["content"] = self._children(path, files, dirs)
            return model
        raise NotFound(f"no such file or directory: {path or '/'}", path=path)

    def _children(self, path: str, files: dict[str, BlobInfo],
                  dirs: set[str]) -> list[dict[str, Any]]:
        children: list[dict[str, Any]] = []
        for child in sorted(dirs):
            if child and posixpath.dirname(child) == path and not _is_hidden(child):
                children.append(self._dir_model(child))
        for child, blob in files.items():
            if posixpath.dirname(child) == path and not _is_hidden(posixpath.basename(child)):
                children.append(self._file_model(child, blob))
        return children

    def _fill(self, workspace_id: str, model: dict[str, Any], as_format: str | None) -> None:
        data = self.files.get(workspace_id, model["path"])
        if model["type"] == "notebook":
            model["content"] = _notebook_json(model["path"], data)
            model["format"] = "json"
            return
        if as_format != "base64":
            try:
                model["content"] = data.decode("utf-8")
                model["format"] = "text"
                return
            except UnicodeDecodeError:
                if as_format == "text":
                    raise InvalidInput(f"{model['path']} is not UTF-8 text",
                                       path=model["path"]) from None
        model["content"] = base64.b64encode(data).decode("ascii")
        model["format"] = "base64"

    # -- writing ---------------------------------------------------------------
    def save(self, workspace_id: str, raw_path: str,
             model: dict[str, Any]) -> tuple[dict[str, Any], bool, list[Change]]:
        """Save a model (PUT): the new model without content, whether it is new,
        and what a live runtime must mirror."""
        path = clean(raw_path)
        if not path:
            raise InvalidInput("cannot save over the workspace's root directory")
        kind = model.get("type")
        files, dirs = self._tree(workspace_id)
        created = path not in files and path not in dirs
        if kind == "directory":
            if path in files:
                raise Conflict(f"{path} is a file", path=path)
            self.blobs.put(f"{self._dirs_prefix(workspace_id)}/{path}/{_MARKER}", b"",
                           check_tree=True)
            return self._dir_model(path, datetime.now(UTC)), created, []
        if kind not in ("file", "notebook"):
            raise InvalidInput("the model's type must be 'file', 'notebook' or 'directory'")
        if path in dirs:
            raise Conflict(f"{path} is a directory", path=path)
        data = _model_bytes(path, kind, model)
        chunk = model.get("chunk")
        if chunk is not None:
            whole = self._chunked(workspace_id, path, chunk, data)
            if whole is None:  # more chunks to come: answer as jupyter_server does
                return {**self._dir_model(path), "type": kind, "name": posixpath.basename(path),
                        "path": path}, created, []
            data = whole
        self.files.put(workspace_id, path, data)
        blob = BlobInfo(path, len(data), datetime.now(UTC))
        return self._file_model(path, blob, kind), created, [Change(path, data)]

    def _chunked(self, workspace_id: str, path: str, chunk: object,
                 data: bytes) -> bytes | None:
        """Lab uploads a large file in chunks 1, 2, ..., -1 (the last); they are
        gathered outside the files and the whole file is saved with the last."""
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk == 0 or chunk < -1:
            raise InvalidInput("chunk must be a positive number, or -1 for the last one")
        key = self._upload_key(workspace_id, path)
        before = b""
        if chunk != 1:
            try:
                before = self.blobs.get(key)
            except NotFound:
                raise InvalidInput(f"chunk {chunk} of {path} came without chunk 1") from None
        whole = before + data
        if len(whole) > MAX_FILE_BYTES:
            self._discard(key)
            raise InvalidInput(f"{path} is larger than {MAX_FILE_BYTES} bytes", path=path)
        if chunk == -1:
            self._discard(key)
            return whole
        self.blobs.put(key, whole, check_tree=True)
        return None

    def new_untitled(self, workspace_id: str, raw_dir: str, kind: str,
                     ext: str) -> tuple[dict[str, Any], list[Change]]:
        """POST to a directory: ``Untitled.ipynb``, ``untitled.py``, ``Untitled Folder``."""
        directory = clean(raw_dir)
        files, dirs = self._tree(workspace_id)
        if directory not in dirs:
            raise NotFound(f"no such directory: {directory or '/'}", path=directory)
        if kind == "directory":
            stem, suffix = "Untitled Folder", ""
        elif kind == "notebook" or (not kind and ext in ("", ".ipynb")):
            kind, stem, suffix = "notebook", "Untitled", ".ipynb"
        else:
            kind, stem, suffix = "file", "untitled", ext or ".txt"
        taken = files.keys() | dirs
        name = _free_name(directory, stem, suffix, taken)
        path = posixpath.join(directory, name) if directory else name
        body: dict[str, Any] = {"type": kind, "format": "text", "content": ""}
        if kind == "notebook":
            body = {"type": kind, "format": "json", "content": _empty_notebook()}
        model, _, changes = self.save(workspace_id, path, body)
        return model, changes

    def copy(self, workspace_id: str, raw_from: str,
             raw_dir: str) -> tuple[dict[str, Any], list[Change]]:
        source = clean(raw_from)
        directory = clean(raw_dir)
        files, dirs = self._tree(workspace_id)
        if source not in files:
            raise NotFound(f"no such file: {source}", path=source)
        if directory not in dirs:
            raise NotFound(f"no such directory: {directory or '/'}", path=directory)
        stem, suffix = posixpath.splitext(posixpath.basename(source))
        name = _free_name(directory, f"{stem}-Copy", suffix, files.keys() | dirs, first=1)
        path = posixpath.join(directory, name) if directory else name
        data = self.files.get(workspace_id, source)
        self.files.put(workspace_id, path, data)
        model = self._file_model(path, BlobInfo(path, len(data), datetime.now(UTC)))
        return model, [Change(path, data)]

    def rename(self, workspace_id: str, raw_old: str,
               raw_new: str) -> tuple[dict[str, Any], list[Change]]:
        old, new = clean(raw_old), clean(raw_new)
        if not old or not new:
            raise InvalidInput("cannot rename the workspace's root directory")
        files, dirs = self._tree(workspace_id)
        if new in files or new in dirs:
            raise Conflict(f"{new} already exists", path=new)
        if old in files:
            data = self.files.get(workspace_id, old)
            self.files.put(workspace_id, new, data)
            self.files.delete(workspace_id, old)
            return (self._file_model(new, BlobInfo(new, len(data), files[old].modified)),
                    [Change(new, data), Change(old, None)])
        if old not in dirs:
            raise NotFound(f"no such file or directory: {old}", path=old)
        if new.startswith(old + "/"):
            raise InvalidInput(f"cannot move {old} into itself")
        changes: list[Change] = []
        for path in [p for p in files if p.startswith(old + "/")]:
            target = new + path[len(old):]
            data = self.files.get(workspace_id, path)
            self.files.put(workspace_id, target, data)
            self.files.delete(workspace_id, path)
            changes += [Change(target, data), Change(path, None)]
        for directory in [d for d in dirs if d == old or d.startswith(old + "/")]:
            self._move_marker(workspace_id, directory, new + directory[len(old):])
        return self._dir_model(new), changes

    def _move_marker(self, workspace_id: str, old: str, new: str) -> None:
        prefix = self._dirs_prefix(workspace_id)
        self.blobs.put(f"{prefix}/{new}/{_MARKER}", b"", check_tree=True)
        self._discard(f"{prefix}/{old}/{_MARKER}")

    def delete(self, workspace_id: str, raw_path: str) -> list[Change]:
        path = clean(raw_path)
        if not path:
            raise InvalidInput("cannot delete the workspace's root directory")
        files, dirs = self._tree(workspace_id)
        if path in files:
            self.files.delete(workspace_id, path)
            self._discard(self._checkpoint_key(workspace_id, path))
            return [Change(path, None)]
        if path not in dirs:
            raise NotFound(f"no such file or directory: {path}", path=path)
        changes: list[Change] = []
        for child in [p for p in files if p.startswith(path + "/")]:
            self.files.delete(workspace_id, child)
            changes.append(Change(child, None))
        for directory in [d for d in dirs if d == path or d.startswith(path + "/")]:
            self._discard(f"{self._dirs_prefix(workspace_id)}/{directory}/{_MARKER}")
        return changes

    # -- checkpoints -----------------------------------------------------------
    def checkpoints(self, workspace_id: str, raw_path: str) -> list[dict[str, Any]]:
        path = self._existing_file(workspace_id, raw_path)
        key = self._checkpoint_key(workspace_id, path)
        found = [b for b in self.blobs.list(posixpath.dirname(key))
                 if b.key == posixpath.basename(key)]
        return [{"id": CHECKPOINT_ID, "last_modified": _time(b.modified)} for b in found]

    def create_checkpoint(self, workspace_id: str, raw_path: str) -> dict[str, Any]:
        path = self._existing_file(workspace_id, raw_path)
        self.blobs.put(self._checkpoint_key(workspace_id, path),
                       self.files.get(workspace_id, path), check_tree=True)
        return {"id": CHECKPOINT_ID, "last_modified": _time(datetime.now(UTC))}

    def restore_checkpoint(self, workspace_id: str, raw_path: str,
                           checkpoint_id: str) -> list[Change]:
        path = self._existing_file(workspace_id, raw_path)
        data = self._checkpoint(workspace_id, path, checkpoint_id)
        self.files.put(workspace_id, path, data)
        return [Change(path, data)]

    def delete_checkpoint(self, workspace_id: str, raw_path: str, checkpoint_id: str) -> None:
        path = self._existing_file(workspace_id, raw_path)
        self._checkpoint(workspace_id, path, checkpoint_id)
        self._discard(self._checkpoint_key(workspace_id, path))

    def _checkpoint(self, workspace_id: str, path: str, checkpoint_id: str) -> bytes:
        if checkpoint_id != CHECKPOINT_ID:
            raise NotFound(f"no checkpoint {checkpoint_id!r} for {path}")
        try:
            return self.blobs.get(self._checkpoint_key(workspace_id, path))
        except NotFound:
            raise NotFound(f"no checkpoint {checkpoint_id!r} for {path}") from None

    def _existing_file(self, workspace_id: str, raw_path: str) -> str:
        path = clean(raw_path)
        files, _ = self._tree(workspace_id)
        if path not in files:
            raise NotFound(f"no such file: {path or '/'}", path=path)
        return path


def _notebook_json(path: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise InvalidInput(f"{path} is not valid JSON: {exc}", path=path) from exc


def _model_bytes(path: str, kind: str, model: dict[str, Any]) -> bytes:
    content = model.get("content")
    if kind == "notebook":
        if not isinstance(content, dict):
            raise InvalidInput("a notebook's content must be a JSON object", path=path)
        return (json.dumps(content, indent=1, sort_keys=True, ensure_ascii=False)
                + "\n").encode("utf-8")
    if not isinstance(content, str):
        raise InvalidInput("a file's content must be a string", path=path)
    fmt = model.get("format")
    if fmt == "text":
        return content.encode("utf-8")
    if fmt == "base64":
        try:
            return base64.b64decode(content.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise InvalidInput(f"the content of {path} is not valid base64", path=path) from exc
    raise InvalidInput("a file's format must be 'text' or 'base64'", path=path)


def _empty_notebook() -> dict[str, Any]:
    return {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _free_name(directory: str, stem: str, suffix: str, taken: Iterable[str],
               first: int = 0) -> str:
    """``stem{suffix}``, else ``stem1{suffix}``, ``stem2{suffix}``... (Jupyter's rule)."""
    used = set(taken)
    index = first
    while True:
        name = f"{stem}{index or ''}{suffix}"
        if (posixpath.join(directory, name) if directory else name) not in used:
            return name
        index += 1
