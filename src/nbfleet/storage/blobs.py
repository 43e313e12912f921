"""The blob store: fsspec over a local directory by default, ``s3://`` in production.

Writes are atomic. Locally a write goes to a temporary file in the same directory,
is fsynced, then renamed over the target; object stores make a PUT atomic already.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime

import fsspec
from fsspec.implementations.local import LocalFileSystem

from nbfleet.model.errors import InvalidInput, NotFound


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
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def put_file(self, key: str, local: str) -> None:
        """Like :meth:`put`, from a local file, without reading it all into memory."""
        path = self._path(key)
        if not self.local:
            self.fs.put_file(local, path)
            return
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        os.close(fd)
        try:
            shutil.copyfile(local, tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get_file(self, key: str, local: str) -> None:
        """Copy a blob to a local file (a kernel's runtime directory, say)."""
        path = self._path(key)
        try:
            if self.local:
                shutil.copyfile(path, local)
            else:
                self.fs.get_file(path, local)
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise NotFound(f"no such file: {key}") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data: bytes = self.fs.cat_file(path)
        except (FileNotFoundError, IsADirectoryError) as exc:
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
