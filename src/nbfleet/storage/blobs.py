"""The blob store: fsspec over a local directory by default, ``s3://`` in production.

Writes are atomic. Locally a write goes to a temporary file in the same directory,
is fsynced, then renamed over the target; object stores make a PUT atomic already.
A key that needs a file where a directory is, or a directory where a file is, is a
:class:`PathConflict` (409), not an OS error: callers choose keys from user input.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import fsspec
from fsspec.implementations.local import LocalFileSystem

from nbfleet.model.errors import Conflict, InvalidInput, NotFound

#: The directory under a local store's root where uploads are spooled: on the same
#: filesystem as the blobs, so a finished upload is renamed into place, not copied.
#: No key starts with it (every key has a prefix such as ``workspaces/``).
STAGING = ".staging"


class PathConflict(Conflict):
    """The key needs a directory where a file is (``a.txt/b`` when ``a.txt`` exists)
    or a file where a directory is."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}", path=key)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlobInfo:
    key: str
    size: int
    modified: datetime | None


class BlobStore:
    def __init__(self, url: str) -> None:
        self.url = url
        fs, root = fsspec.core.url_to_fs(url)
        self.fs = fs
        self.local = isinstance(fs, LocalFileSystem)
        self.root = os.path.realpath(root) if self.local else root.rstrip("/")
        if self.local:
            os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        path = f"{self.root}/{key}"
        if self.local:
            # Refuse a key that resolves outside the root, e.g. through a symlink.
            real = os.path.realpath(path)
            if real != path:
                raise InvalidInput(f"refusing {key!r}: it passes through a symlink", path=key)
        return path

    def local_path(self, key: str) -> str:
        """The file behind a key of a local store (to stream it without reading it
        into memory); NotFound if there is none."""
        path = self._path(key)
        if not self.local or not os.path.isfile(path):
            raise NotFound(f"no such file: {key}")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        with _os_errors(key):
            fd, tmp = tempfile.mkstemp(dir=self._make_parent(key, path), prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                self._install(key, tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise

    def put_file(self, key: str, local: str, move: bool = False) -> None:
        """Like :meth:`put`, from a local file, without reading it all into memory.

        With ``move`` a local store renames ``local`` into place (it must be on the
        store's filesystem: see :meth:`staging_dir`) instead of copying it.
        """
        path = self._path(key)
        if not self.local:
            self.fs.put_file(local, path)
            return
        with _os_errors(key):
            directory = self._make_parent(key, path)
            if move:
                with open(local, "rb") as handle:
                    os.fsync(handle.fileno())
                self._install(key, local, path)
                return
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
            os.close(fd)
            try:
                shutil.copyfile(local, tmp)
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                self._install(key, tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise

    def staging_dir(self) -> str:
        """Where an upload is spooled before it becomes a blob: under a local store's
        root (so :meth:`put_file` with ``move`` renames it), else the system's
        temporary directory (an object store's PUT copies it anyway)."""
        if not self.local:
            return tempfile.gettempdir()
        directory = os.path.join(self.root, STAGING)
        os.makedirs(directory, exist_ok=True)
        return directory

    @staticmethod
    def _make_parent(key: str, path: str) -> str:
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise PathConflict(key, "a parent of this path is a file") from None
        return directory

    @staticmethod
    def _install(key: str, tmp: str, path: str) -> None:
        try:
            os.replace(tmp, path)
        except IsADirectoryError:
            raise PathConflict(key, "a directory of this name exists") from None

    def get_file(self, key: str, local: str) -> None:
        """Copy a blob to a local file (a kernel's runtime directory, say)."""
        path = self._path(key)
        try:
            if self.local:
                shutil.copyfile(path, local)
            else:
                self.fs.get_file(path, local)
        except OSError as exc:
            if not _missing(exc):
                raise
            raise NotFound(f"no such file: {key}") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data: bytes = self.fs.cat_file(path)
        except OSError as exc:
            if not _missing(exc):
                raise
            raise NotFound(f"no such file: {key}") from exc
        return data

    def exists(self, key: str) -> bool:
        return bool(self.fs.isfile(self._path(key)))

    def delete(self, key: str) -> None:
        path = self._path(key)
        if not self.fs.isfile(path):
            raise NotFound(f"no such file: {key}")
        self.fs.rm_file(path)

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix.rstrip("/"))
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def list(self, prefix: str) -> list[BlobInfo]:
        """Every blob under ``prefix``, with keys relative to it, sorted."""
        base = self._path(prefix.rstrip("/"))
        if not self.fs.exists(base):
            return []
        found = self.fs.find(base, detail=True)
        out: list[BlobInfo] = []
        for path, info in found.items():
            rel = path[len(base) + 1 :] if path.startswith(base + "/") else path
            if rel.rsplit("/", 1)[-1].startswith(".tmp-") or info.get("islink"):
                continue
            out.append(BlobInfo(rel, int(info.get("size") or 0), _modified(info)))
        return sorted(out, key=lambda blob: blob.key)


def _modified(info: dict[str, object]) -> datetime | None:
    raw = info.get("mtime") or info.get("LastModified")
    if isinstance(raw, (int, float)):
        return datetime.fromtimestamp(raw, UTC)
    if isinstance(raw, datetime):
        return raw.astimezone(UTC)
    return None


def _missing(exc: OSError) -> bool:
    """Whether reading a key failed because it names no file: it is missing, it is a
    directory, a parent is a file, or a name is too long to exist at all."""
    return (isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError))
            or exc.errno == errno.ENAMETOOLONG)


@contextlib.contextmanager
def _os_errors(key: str) -> Iterator[None]:
    """Name too long for the filesystem: the caller's input, not the server, is wrong."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise InvalidInput(f"{key}: a name in this path is too long", path=key) from None
        raise


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
