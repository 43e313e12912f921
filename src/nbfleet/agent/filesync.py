"""Copies workspace files between the blob store and a runtime's working directory.

The working directory is only a cache: files are materialized from the blob store
when a runtime starts, and the kernel's changes are synced back while it runs
(``livesync``, only the paths that changed: :func:`sync_paths`) and when it is
suspended or released (:func:`sync_back`).
Symlinks and paths the API would refuse are never synced back, so kernel code
cannot smuggle a file from outside its directory into the store.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator
from stat import S_ISREG

from nbfleet.model.errors import DomainError
from nbfleet.storage import beneath
from nbfleet.storage.files import MAX_FILE_BYTES, WorkspaceFiles
from nbfleet.storage.paths import confine

log = logging.getLogger(__name__)

#: path -> (size, mtime_ns) of what the store and the directory last agreed on.
Manifest = dict[str, tuple[int, int]]
#: path -> (its stamp in the manifest, sha256 of the bytes the store holds for it),
#: for the paths :func:`sync_paths` uploaded. An entry holds only while the manifest
#: still has that stamp: anything else that changes the path (an API write or
#: delete, a full :func:`sync_back`) changes or drops its stamp there.
Digests = dict[str, tuple[tuple[int, int], bytes]]

_SKIP_DIRS = frozenset({"__pycache__", ".ipynb_checkpoints"})
#: The agent's own half-written files (``beneath.write``), never synced back.
TMP_PREFIX = ".nbfleet-tmp-"
#: Why a path is not a regular file below the working directory any more.
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


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
    """Regular files under ``workdir`` (no links, no caches) and their stamps.

    Only stats, no reads. A file the kernel removes while it is listed is left out.
    """
    found: Manifest = {}
    for relative, dir_fd, name in _entries(workdir):
        try:
            stat = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
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


def sync_paths(files: WorkspaceFiles, workspace_id: str, workdir: str, manifest: Manifest,
               paths: Iterable[str], digests: Digests | None = None) -> None:
    """Bring the store up to date for ``paths`` only (changed, created or removed
    since ``manifest``, as a scan found), checking each again now: its cost is in
    the paths given, not in the files of the workspace.

    ``manifest`` is updated in place as each path is done, so a store error part
    way keeps what was done; the error is raised and the rest is retried later. A
    path that is no longer a regular file below ``workdir`` (removed, or replaced by
    a link) is deleted from the store, as :func:`sync_back` does. Nothing is done
    when ``workdir`` itself is missing: that is a runtime going away, not the kernel
    deleting every file.

    With ``digests`` (kept by the caller from one call to the next), a file whose
    stamp changed but whose bytes are those this function last uploaded for it (the
    same content written again, a ``touch``) is not uploaded again.
    """
    if not os.path.isdir(workdir) or os.path.islink(workdir):
        return
    for path in paths:
        _sync_path(files, workspace_id, workdir, manifest, path,
                   {} if digests is None else digests)


def _sync_path(files: WorkspaceFiles, workspace_id: str, workdir: str, manifest: Manifest,
               path: str, digests: Digests) -> None:
    known = manifest.get(path)
    stamp, data = _read_regular(workdir, path, known)
    last = digests.pop(path, None)
    if stamp is None:
        if path in manifest:
            with contextlib.suppress(DomainError):
                files.delete(workspace_id, path)
            manifest.pop(path, None)
        return
    if data is None:  # unchanged, or too large (said already)
        if stamp == known and last is not None:
            digests[path] = last
        manifest[path] = stamp
        return
    digest = hashlib.sha256(data).digest()
    if last == (known, digest):  # what this function uploaded, and nothing since
        digests[path] = (stamp, digest)
        manifest[path] = stamp
        return
    try:
        files.put(workspace_id, path, data)
    except DomainError as exc:  # e.g. a notebook saved half-written, or a bad name
        log.warning("not syncing %s: %s", path, exc.detail)
    else:
        digests[path] = (stamp, digest)
    manifest[path] = stamp  # as sync_back: tried again once it changes again


def _read_regular(workdir: str, path: str, known: tuple[int, int] | None
                  ) -> tuple[tuple[int, int] | None, bytes | None]:
    """(stamp, bytes) of ``workdir/path`` read through a descriptor checked to be a
    regular file below ``workdir`` (no link followed anywhere on the way): stamp
    None when it is not one; bytes None when its stamp is ``known`` or it is larger
    than MAX_FILE_BYTES."""
    parts = [part for part in path.split("/") if part]
    if not parts or any(part in (".", "..") for part in parts):
        return None, None
    try:
        with beneath.directory(workdir, parts[:-1]) as dir_fd, \
                beneath.open_regular(dir_fd, parts[-1]) as opened:
            if opened is None:
                # Not a regular file (gone, a link, a fifo)? Or one that could not be
                # opened now (EMFILE, EACCES): that raises, and is retried later.
                found = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
                if S_ISREG(found.st_mode):
                    raise OSError(f"{path} could not be opened")
                return None, None
            fd, stat = opened
            stamp = (stat.st_size, stat.st_mtime_ns)
            if stamp == known:
                return stamp, None
            data = beneath.read_fd(fd, MAX_FILE_BYTES)
    except OSError as exc:
        if exc.errno in _GONE:  # removed, or a link planted on the way
            return None, None
        raise
    if data is None:
        log.warning("not syncing %s: larger than %d bytes", path, MAX_FILE_BYTES)
    return stamp, data
