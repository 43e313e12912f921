"""Kernel-state snapshots and package layers in the blob store.

A kernel writes its state to a local directory as ``manifest.json`` plus
content-addressed ``blobs/<sha256>`` (see ``nbfleet.kernel``). This module moves
that directory to and from the blob store:

- Blobs live under the workspace's own ``cas/`` prefix, named by their SHA-256, so a
  value that did not change (a 1 GB array) is uploaded once, however often the
  workspace suspends. The store is per workspace: tenants never share, or learn of,
  each other's content.
- A manifest is uploaded after all the blobs it names, under a fresh key. Until the
  control plane records that key, the previous snapshot stays the current one, so a
  crash mid-upload leaves the last complete snapshot standing.
- Downloads verify every blob's hash: a corrupt snapshot is reported, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nbfleet.model.errors import NotFound
from nbfleet.storage import beneath
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import workspace_prefix

MANIFEST = "manifest.json"
#: A kernel's manifest (names, small values inline) is read whole: bounded.
MAX_MANIFEST_BYTES = 256 << 20
_PARALLEL = 4
_CHUNK = 4 * 1024 * 1024


class CorruptSnapshot(Exception):
    """The snapshot cannot be trusted: a blob is missing, or its hash is wrong."""


@dataclass(frozen=True, slots=True)
class Uploaded:
    key: str
    bytes_total: int
    bytes_written: int


def cas_key(workspace_id: str, digest: str) -> str:
    if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
        raise CorruptSnapshot(f"not a SHA-256 digest: {digest[:80]!r}")
    return f"{workspace_prefix(workspace_id)}/cas/{digest[:2]}/{digest}"


def manifest_key(workspace_id: str, kernel_id: str) -> str:
    return f"{workspace_prefix(workspace_id)}/snapshots/{kernel_id}/{secrets.token_hex(8)}.json"


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def referenced_blobs(manifest: dict[str, Any]) -> list[str]:
    """The manifest's blobs, each checked to be a digest before any is used in a
    path (the kernel wrote the manifest: ``../x`` must never reach ``os.link``)."""
    blobs = manifest.get("blobs", [])
    if not isinstance(blobs, list) or not all(isinstance(b, str) for b in blobs):
        raise CorruptSnapshot("the manifest's blob list is malformed")
    for digest in blobs:
        cas_key("check", digest)
    return list(dict.fromkeys(blobs))


def upload_state(store: BlobStore, workspace_id: str, kernel_id: str, state_dir: str,
                 known: set[str] | None = None) -> Uploaded:
    """Upload a kernel's flushed state; the manifest goes last.

    The kernel owns ``state_dir`` and may still run: each file is opened without
    following a link and uploaded through that descriptor. ``known``: digests this
    caller saw in the store already (not asked again: a HEAD each on S3); those
    uploaded or found are added.
    """
    with beneath.directory(state_dir) as top, beneath.open_regular(top, MANIFEST) as opened:
        if opened is None:
            raise CorruptSnapshot("the kernel's manifest is not a regular file")
        raw = beneath.read_fd(opened[0], MAX_MANIFEST_BYTES)
    if raw is None:
        raise CorruptSnapshot("the kernel's manifest is too large")
    blobs = referenced_blobs(json.loads(raw))

    def upload(digest: str) -> tuple[int, int]:
        key = cas_key(workspace_id, digest)
        with beneath.directory(state_dir, ["blobs"]) as folder, \
                beneath.open_regular(folder, digest) as blob:
            if blob is None:
                raise CorruptSnapshot(f"blob {digest[:12]} is not a regular file")
            size = blob[1].st_size
            if (known is not None and digest in known) or store.exists(key):
                return size, 0
            store.put_file(key, beneath.fd_path(blob[0]))
        return size, size

    with ThreadPoolExecutor(_PARALLEL) as pool:
        sizes = list(pool.map(upload, blobs))
    if known is not None:
        known.update(blobs)
    key = manifest_key(workspace_id, kernel_id)
    store.put(key, raw)
    return Uploaded(key, len(raw) + sum(s for s, _ in sizes), len(raw) + sum(w for _, w in sizes))


def read_manifest(store: BlobStore, workspace_id: str, key: str) -> bytes:
    """A snapshot's manifest as stored (not verified: see :func:`download_state`)."""
    if not key.startswith(f"{workspace_prefix(workspace_id)}/snapshots/"):
        raise CorruptSnapshot(f"snapshot key {key!r} is not this workspace's")
    try:
        raw = store.get(key)
    except NotFound as exc:
        raise CorruptSnapshot(f"the manifest is missing: {key}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptSnapshot("the manifest is too large")
    return raw


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """A stored manifest's JSON object (see :func:`referenced_blobs` for its blobs)."""
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise CorruptSnapshot(f"the manifest is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise CorruptSnapshot("the manifest is not a JSON object")
    return manifest


def download_state(store: BlobStore, workspace_id: str, key: str, state_dir: str,
                   reuse: str | None = None) -> int:
    """Fetch a snapshot into ``state_dir`` and verify it; returns its size in bytes.

    ``reuse``: an earlier download of the agent's own (a standby's staged state),
    whose verified blobs are linked instead of fetched again.
    """
    raw = read_manifest(store, workspace_id, key)
    blobs = referenced_blobs(parse_manifest(raw))
    os.makedirs(os.path.join(state_dir, "blobs"), exist_ok=True)

    def fetch(digest: str) -> int:
        local = os.path.join(state_dir, "blobs", digest)
        if reuse is not None:
            with contextlib.suppress(OSError):
                os.link(os.path.join(reuse, "blobs", digest), local)
                return os.path.getsize(local)
        try:
            store.get_file(cas_key(workspace_id, digest), local)
        except NotFound as exc:
            raise CorruptSnapshot(f"blob {digest[:12]} is missing") from exc
        if sha256_file(local) != digest:
            raise CorruptSnapshot(f"blob {digest[:12]} does not match its hash")
        return os.path.getsize(local)

    with ThreadPoolExecutor(_PARALLEL) as pool:
        total = sum(pool.map(fetch, blobs))
    with open(os.path.join(state_dir, MANIFEST), "wb") as handle:
        handle.write(raw)
    return total + len(raw)


# ---------------------------------------------------------------- package layers
def pack_layer(root: str) -> bytes | None:
    """A deterministic tar of a package directory: same files, same bytes, same key.

    Bytecode caches are left out (they are rebuilt) and times are zeroed, so an
    unchanged layer hashes the same and is never stored twice. The kernel owns the
    directory and may still run: links are left out (a layer holds files, never
    links out of itself) and each file is read through a checked descriptor.
    """
    buffer = io.BytesIO()
    packed = 0
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, dir_fd, name in beneath.files(root, frozenset({"__pycache__"})):
            if name.endswith(".pyc"):
                continue
            with beneath.open_regular(dir_fd, name) as opened:
                if opened is None:
                    continue
                fd, st = opened
                info = tarfile.TarInfo(relative)
                info.size, info.mtime = st.st_size, 0
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                with os.fdopen(os.dup(fd), "rb") as handle:
                    tar.addfile(info, handle)
                packed += 1
    return buffer.getvalue() if packed else None


def store_layer(store: BlobStore, workspace_id: str, root: str) -> str | None:
    """Store the layer content-addressed; returns its key (None for an empty layer)."""
    data = pack_layer(root)
    if data is None:
        return None
    key = cas_key(workspace_id, hashlib.sha256(data).hexdigest())
    if not store.exists(key):
        store.put(key, data)
    return key


def restore_layer(store: BlobStore, workspace_id: str, key: str, root: str) -> None:
    """Unpack a stored layer into ``root`` (which must be empty); no pip is run."""
    if not key.startswith(f"{workspace_prefix(workspace_id)}/cas/"):
        raise CorruptSnapshot(f"layer key {key!r} is not this workspace's")
    try:
        data = store.get(key)
    except NotFound as exc:
        raise CorruptSnapshot(f"the package layer is missing: {key}") from exc
    if hashlib.sha256(data).hexdigest() != key.rsplit("/", 1)[-1]:
        raise CorruptSnapshot("the package layer does not match its hash")
    os.makedirs(root, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(root, filter="data")  # refuses links and paths that escape
