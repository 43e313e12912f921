"""Copies workspace files between the blob store and a runtime's working directory.

The working directory is only a cache: files are materialized from the blob store
when a runtime starts and the kernel's changes are synced back when it is released.
Symlinks and paths the API would refuse are never synced back, so kernel code
cannot smuggle a file from outside its directory into the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from stat import S_ISREG

from nbfleet.model.errors import DomainError
from nbfleet.storage import beneath
from nbfleet.storage.files import MAX_FILE_BYTES, WorkspaceFiles
from nbfleet.storage.paths import confine

log = logging.getLogger(__name__)

#: path -> (size, mtime_ns) of what the store and the directory last agreed on.
Manifest = dict[str, tuple[int, int]]

_SKIP_DIRS = frozenset({"__pycache__", ".ipynb_checkpoints"})
#: The agent's own half-written files (``beneath.write``), never synced back.
TMP_PREFIX = ".nbfleet-tmp-"


def materialize(files: WorkspaceFiles, workspace_id: str, workdir: str,
                owner: beneath.Owner = None) -> Manifest:
    os.makedirs(workdir, exist_ok=True)
    manifest: Manifest = {}
    for blob in files.list(workspace_id):
        manifest[blob.key] = write_local(workdir, blob.key, files.get(workspace_id, blob.key),
                                         owner)
    return manifest


def write_local(workdir: str, path: str, data: bytes,
                owner: beneath.Owner = None) -> tuple[int, int]:
    """Write a file into a kernel's working directory, never through a link the
    kernel planted there, and give it (and any directory made for it) to ``owner``."""
    stat = beneath.write(workdir, confine(path), data, owner)
    return (stat.st_size, stat.st_mtime_ns)


def remove_local(workdir: str, path: str) -> None:
    beneath.unlink(workdir, confine(path))


def _entries(workdir: str) -> Iterator[tuple[str, int, str]]:
    for relative, dir_fd, name in beneath.files(workdir, _SKIP_DIRS):
        if not name.startswith(TMP_PREFIX):
            yield relative, dir_fd, name


def scan(workdir: str) -> Manifest:
    """Regular files under ``workdir`` (no links, no caches) and their stamps."""
    found: Manifest = {}
    for relative, dir_fd, name in _entries(workdir):
        stat = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if S_ISREG(stat.st_mode):
            found[relative] = (stat.st_size, stat.st_mtime_ns)
    return found


def sync_back(
    files: WorkspaceFiles, workspace_id: str, workdir: str, manifest: Manifest
) -> Manifest:
    """Upload what the kernel changed or created; delete what it removed.

    The kernel may still run: each file is read through the descriptor that was
    checked to be a regular file below ``workdir``, and at most MAX_FILE_BYTES.
    """
    if not os.path.isdir(workdir):
        return manifest
    current: Manifest = {}
    for path, dir_fd, name in _entries(workdir):
        with beneath.open_regular(dir_fd, name) as opened:
            if opened is None:
                continue
            fd, stat = opened
            stamp = (stat.st_size, stat.st_mtime_ns)
            current[path] = stamp
            if manifest.get(path) == stamp:
                continue
            data = beneath.read_fd(fd, MAX_FILE_BYTES)
        if data is None:
            log.warning("not syncing %s: larger than %d bytes", path, MAX_FILE_BYTES)
            continue
        try:
            files.put(workspace_id, path, data)
        except DomainError as exc:  # e.g. a notebook saved half-written, or a bad name
            log.warning("not syncing %s: %s", path, exc.detail)
            continue
    for path in manifest.keys() - current.keys():
        with contextlib.suppress(DomainError):
            files.delete(workspace_id, path)
    return current
