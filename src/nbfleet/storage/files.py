"""Workspace files in the blob store, which is their source of truth."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from nbfleet.model.errors import ContentTooLarge, InvalidInput
from nbfleet.storage.blobs import BlobInfo, BlobStore, PathConflict
from nbfleet.storage.paths import confine
from nbfleet.storage.uploads import Upload

#: The largest workspace file: the API refuses a larger body with 413 as it reads
#: it, and the agents' file sync skips larger files.
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
            raise ContentTooLarge(f"{path} is larger than {MAX_FILE_BYTES} bytes", path=path)
        if path.endswith(".ipynb"):
            validate_notebook(path, data)
        with _conflicts(path):
            self.blobs.put(key, data, check_tree=True)  # a user's path
        return confine(path)

    def upload(self, workspace_id: str, path: str) -> Upload:
        """Start writing a file whose bytes arrive in pieces (an HTTP body): write
        them to the upload, then :meth:`commit` it. A bad path is refused before
        any byte is read."""
        self._key(workspace_id, path)
        return Upload(self.blobs, MAX_FILE_BYTES, path)

    def commit(self, workspace_id: str, path: str, upload: Upload) -> str:
        """Make a finished upload the file at ``path`` (a notebook is validated
        first, and an invalid one leaves the previous version in place)."""
        key = self._key(workspace_id, path)
        if path.endswith(".ipynb"):
            validate_notebook(path, upload.read())
        with _conflicts(path):
            upload.commit(key)
        return confine(path)

    def delete(self, workspace_id: str, path: str) -> None:
        self.blobs.delete(self._key(workspace_id, path))

    def delete_all(self, workspace_id: str) -> None:
        self.blobs.delete_prefix(workspace_prefix(workspace_id))


@contextlib.contextmanager
def _conflicts(path: str) -> Iterator[None]:
    """Say what conflicts in the workspace's terms, not the store's keys."""
    try:
        yield
    except PathConflict as exc:
        raise PathConflict(path, exc.reason) from None
