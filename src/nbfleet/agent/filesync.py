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
import tempfile

from nbfleet.model.errors import DomainError
from nbfleet.storage.files import MAX_FILE_BYTES, WorkspaceFiles
from nbfleet.storage.paths import confine

log = logging.getLogger(__name__)

#: path -> (size, mtime_ns) of what the store and the directory last agreed on.
Manifest = dict[str, tuple[int, int]]

_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}
#: The agent's own half-written files, never synced back.
TMP_PREFIX = ".nbfleet-tmp-"


def materialize(files: WorkspaceFiles, workspace_id: str, workdir: str) -> Manifest:
    os.makedirs(workdir, exist_ok=True)
    manifest: Manifest = {}
    for blob in files.list(workspace_id):
        manifest[blob.key] = write_local(workdir, blob.key, files.get(workspace_id, blob.key))
    return manifest


def write_local(workdir: str, path: str, data: bytes) -> tuple[int, int]:
    target = os.path.join(workdir, confine(path))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(target):
        os.unlink(target)
    # A short name of its own: ``<name>.tmp`` would pass the 255-byte limit for the
    # longest names the API accepts.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=TMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    stat = os.stat(target)
    return (stat.st_size, stat.st_mtime_ns)


def remove_local(workdir: str, path: str) -> None:
    target = os.path.join(workdir, confine(path))
    if os.path.isfile(target) and not os.path.islink(target):
        os.unlink(target)


def scan(workdir: str) -> Manifest:
    """Regular files under ``workdir`` (no symlinks, no caches) and their stamps."""
    found: Manifest = {}
    for root, dirs, names in os.walk(workdir, followlinks=False):
        dirs[:] = [
            d for d in dirs
            if d not in _SKIP_DIRS and not os.path.islink(os.path.join(root, d))
        ]
        for name in names:
            full = os.path.join(root, name)
            if os.path.islink(full) or not os.path.isfile(full) or name.startswith(TMP_PREFIX):
                continue
            rel = os.path.relpath(full, workdir).replace(os.sep, "/")
            stat = os.stat(full)
            found[rel] = (stat.st_size, stat.st_mtime_ns)
    return found


def sync_back(
    files: WorkspaceFiles, workspace_id: str, workdir: str, manifest: Manifest
) -> Manifest:
    """Upload what the kernel changed or created; delete what it removed."""
    if not os.path.isdir(workdir):
        return manifest
    current = scan(workdir)
    for path, stamp in current.items():
        if manifest.get(path) == stamp:
            continue
        if stamp[0] > MAX_FILE_BYTES:
            log.warning("not syncing %s: larger than %d bytes", path, MAX_FILE_BYTES)
            continue
        with open(os.path.join(workdir, path), "rb") as handle:
            data = handle.read()
        try:
            files.put(workspace_id, path, data)
        except DomainError as exc:  # e.g. a notebook saved half-written, or a bad name
            log.warning("not syncing %s: %s", path, exc.detail)
            continue
    for path in manifest.keys() - current.keys():
        with contextlib.suppress(DomainError):
            files.delete(workspace_id, path)
    return current
