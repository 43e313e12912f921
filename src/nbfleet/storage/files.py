"""Workspace files in the blob store, which is their source of truth."""

from __future__ import annotations

from nbfleet.model.errors import InvalidInput
from nbfleet.storage.blobs import BlobInfo, BlobStore
from nbfleet.storage.paths import confine

MAX_FILE_BYTES = 100 * 1024 * 1024


def workspace_prefix(workspace_id: str) -> str:
    if not workspace_id or "/" in workspace_id or workspace_id in (".", ".."):
        raise ValueError(f"invalid workspace id {workspace_id!r}")
    return f"workspaces/{workspace_id}"


def files_prefix(workspace_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}/files"


def validate_notebook(path: str, data: bytes) -> None:
    """Refuse a ``.ipynb`` that nbformat cannot read or that fails its schema."""
    import nbformat  # costs ~1 s (jsonschema) to import: only when a notebook arrives

    try:
        notebook = nbformat.reads(data.decode("utf-8"), as_version=4)  # type: ignore[no-untyped-call]
        nbformat.validate(notebook)
    except Exception as exc:  # nbformat raises several unrelated types
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidInput(f"{path} is not a valid notebook: {message}", path=path) from exc


class WorkspaceFiles:
    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    def _key(self, workspace_id: str, path: str) -> str:
        return f"{files_prefix(workspace_id)}/{confine(path)}"

    def list(self, workspace_id: str) -> list[BlobInfo]:
        return self.blobs.list(files_prefix(workspace_id))

    def get(self, workspace_id: str, path: str) -> bytes:
        return self.blobs.get(self._key(workspace_id, path))

    def put(self, workspace_id: str, path: str, data: bytes) -> str:
        key = self._key(workspace_id, path)
        if len(data) > MAX_FILE_BYTES:
            raise InvalidInput(f"{path} is larger than {MAX_FILE_BYTES} bytes", path=path)
        if path.endswith(".ipynb"):
            validate_notebook(path, data)
        self.blobs.put(key, data)
        return confine(path)

    def delete(self, workspace_id: str, path: str) -> None:
        self.blobs.delete(self._key(workspace_id, path))

    def delete_all(self, workspace_id: str) -> None:
        self.blobs.delete_prefix(workspace_prefix(workspace_id))
