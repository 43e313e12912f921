"""The blob store: a local directory by default, ``s3://bucket/prefix`` in production.

Writes are atomic. Locally a write goes to a temporary file in the same directory,
is fsynced, then renamed over the target; object stores make a PUT atomic already.
A key that needs a file where a directory is, or a directory where a file is, is a
:class:`PathConflict` (409), not an OS error: callers choose keys from user input.
An object store has no directories, so there the same rule is checked before a
write only when asked (``check_tree``: keys that come from users, such as a
workspace's files), which costs a request per parent: every host can then lay
those trees out on a disk. Keys the platform makes itself (job logs, snapshots)
skip it.

The S3 backend is :mod:`nbfleet.storage.s3`, imported only for an ``s3://`` URL.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from fsspec.implementations.local import LocalFileSystem

from nbfleet.model.errors import Conflict, InvalidInput, NotFound

if TYPE_CHECKING:
    from nbfleet.storage.s3 import S3Backend

#: The directory under a local store's root where uploads are spooled: on the same
#: filesystem as the blobs, so a finished upload is renamed into place, not copied.
#: No key starts with it (every key has a prefix such as ``workspaces/``).
STAGING = ".staging"

#: URL schemes of the S3 backend (s3fs serves both).
S3_SCHEMES = ("s3://", "s3a://")

#: What starts a URL with a scheme (``memory:``, ``http:``, ``s3:/``): not a path.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


class BlobStoreUnusable(Exception):
    """The store cannot be used at all (no such bucket, credentials refused, no
    endpoint): a start-up error for a person to fix, not a request's."""


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
    """Blobs by key (``a/b/c``: plain names, no ``.``, ``..`` or empty part) under a
    local directory or ``s3://bucket[/prefix]``; any other URL is a ValueError."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.s3 = url.startswith(S3_SCHEMES)
        self.local = not self.s3
        self._s3: S3Backend | None = None
        if self.s3:
            from nbfleet.storage.s3 import S3Backend

            self._s3 = S3Backend(url)
            self.root = self._s3.root
            return
        if not url or _SCHEME.match(url):
            raise ValueError(f"{url!r} is neither a directory nor s3://bucket[/prefix] "
                             "(write ./NAME for a directory whose name has a ':')")
        self.fs = LocalFileSystem()
        self.root = os.path.realpath(url)
        os.makedirs(self.root, exist_ok=True)

    def check(self) -> None:
        """Raise :class:`BlobStoreUnusable`, with what to fix, unless the store can be
        reached: run at start-up, so a wrong bucket or credential is one clear line
        then rather than a failed suspend later."""
        if self._s3 is not None:
            self._s3.check()

    def _key(self, key: str) -> str:
        if any(part in ("", ".", "..") for part in key.split("/")):
            # Lexically: an object store resolves nothing, so "a/../b" would be a
            # key of its own, and "../x" one beside this store's prefix.
            raise InvalidInput(f"refusing {key!r}: not a plain relative key", path=key)
        return key

    def _path(self, key: str) -> str:
        """The local file of a key, refused if it resolves elsewhere."""
        path = f"{self.root}/{self._key(key)}"
        # Refuse a key that resolves outside the root, e.g. through a symlink.
        if os.path.realpath(path) != path:
            raise InvalidInput(f"refusing {key!r}: it passes through a symlink", path=key)
        return path

    def local_path(self, key: str) -> str:
        """The file behind a key of a local store (to stream it without reading it
        into memory); NotFound if there is none."""
        if self._s3 is not None:
            raise NotFound(f"no such file: {key}")
        path = self._path(key)
        if not os.path.isfile(path):
            raise NotFound(f"no such file: {key}")
        return path

    def signed_url(self, key: str, expires_in_s: int, filename: str | None = None) -> str:
        """A URL that downloads the blob without credentials for ``expires_in_s``
        seconds (S3's presigned GET), always as an attachment named ``filename``
        (default: the key's last part) of type application/octet-stream. A local
        store has none: nbfleet serves and signs those itself
        (:mod:`nbfleet.jobs.results`)."""
        if self._s3 is None:
            raise ValueError("a local blob store has no presigned URLs")
        key = self._key(key)
        return self._s3.signed_url(key, expires_in_s, filename or key.rsplit("/", 1)[-1])

    def put(self, key: str, data: bytes, *, check_tree: bool = False) -> None:
        """Write ``data`` at ``key``. ``check_tree``: on an object store, refuse what a
        filesystem would (:class:`PathConflict`), at a request per parent; a local
        store always refuses it."""
        if self._s3 is not None:
            self._s3.put(self._key(key), data, check_tree)
            return
        path = self._path(key)
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

    def put_file(self, key: str, local: str, move: bool = False, *,
                 check_tree: bool = False) -> None:
        """Like :meth:`put`, from a local file, without reading it all into memory.

        With ``move`` a local store renames ``local`` into place (it must be on the
        store's filesystem: see :meth:`staging_dir`) instead of copying it.
        """
        if self._s3 is not None:
            self._s3.put_file(self._key(key), local, check_tree)
            return
        path = self._path(key)
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
        if self._s3 is not None:
            self._s3.get_file(self._key(key), local)
            return
        path = self._path(key)
        try:
            shutil.copyfile(path, local)
        except OSError as exc:
            if not _missing(exc):
                raise
            raise NotFound(f"no such file: {key}") from exc

    def get(self, key: str) -> bytes:
        if self._s3 is not None:
            return self._s3.get(self._key(key))
        path = self._path(key)
        try:
            data: bytes = self.fs.cat_file(path)
        except OSError as exc:
            if not _missing(exc):
                raise
            raise NotFound(f"no such file: {key}") from exc
        return data

    def exists(self, key: str) -> bool:
        if self._s3 is not None:
            return self._s3.exists(self._key(key))
        return bool(self.fs.isfile(self._path(key)))

    def delete(self, key: str) -> None:
        if self._s3 is not None:
            self._s3.delete(self._key(key))
            return
        path = self._path(key)
        if not self.fs.isfile(path):
            raise NotFound(f"no such file: {key}")
        self.fs.rm_file(path)

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete these blobs (batched on S3); a key that is not there is no error."""
        if self._s3 is not None:
            self._s3.delete_many([self._key(key) for key in keys])
            return
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))

    def delete_prefix(self, prefix: str) -> None:
        if self._s3 is not None:
            self._s3.delete_prefix(self._key(prefix.rstrip("/")))
            return
        path = self._path(prefix.rstrip("/"))
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def list(self, prefix: str) -> list[BlobInfo]:
        """Every blob under ``prefix``, with keys relative to it, sorted."""
        if self._s3 is not None:
            return self._s3.list(self._key(prefix.rstrip("/")))
        base = self._path(prefix.rstrip("/"))
        if not self.fs.exists(base):
            return []
        found = self.fs.find(base, detail=True)
        out: list[BlobInfo] = []
        for path, info in found.items():
            if not path.startswith(base + "/") or info.get("type", "file") != "file":
                continue  # ``prefix`` itself, when it names a blob
            rel = path[len(base) + 1 :]
            # A temporary file of a write in progress, or left by a crash; a symlink.
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
