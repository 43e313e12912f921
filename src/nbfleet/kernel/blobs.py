"""The kernel's local, content-addressed blob directory (``<STATE_DIR>/blobs``).

A part is named by its sha256, so an unchanged value is never written twice
and the agent can upload only what the remote store lacks. Small parts go
inline in the manifest instead: a file per 200-byte float is not worth it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

INLINE_LIMIT = 64 * 1024
_CHUNK = 16 * 1024 * 1024

Ref = dict[str, str]
"""``{"inline": base64}`` or ``{"blob": sha256hex}``."""

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ChangedWhileStoring(RuntimeError):
    """The bytes changed between hashing and writing (another thread mutated them)."""


class BlobStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, sha: str) -> Path:
        if not SHA256_HEX.fullmatch(sha):  # never let a manifest name a path
            raise ValueError(f"not a sha256: {sha!r}")
        return self.directory / sha

    def has(self, sha: str) -> bool:
        return self.path(sha).exists()

    def put(self, data: memoryview) -> Ref:
        """Store ``data`` (inline if small); writes only if the blob is new."""
        if data.nbytes < INLINE_LIMIT:
            return {"inline": base64.b64encode(data).decode("ascii")}
        sha = hashlib.sha256(data).hexdigest()  # releases the GIL on big inputs
        target = self.path(sha)
        if not target.exists():
            self._write(target, sha, data)
        return {"blob": sha}

    def _write(self, target: Path, sha: str, data: memoryview) -> None:
        """Write and re-hash in one pass: a blob's content always matches its name,
        even if the memory changed since it was hashed (then nothing is kept)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{sha}.{os.getpid()}.{threading.get_ident()}.tmp"
        data = data.cast("B")
        check = hashlib.sha256()
        with open(tmp, "wb") as out:
            for start in range(0, data.nbytes, _CHUNK):
                part = data[start:start + _CHUNK]
                check.update(part)
                out.write(part)
        if check.hexdigest() != sha:
            tmp.unlink()
            raise ChangedWhileStoring(f"content of blob {sha[:12]} changed while stored")
        os.replace(tmp, target)

    def read(self, sha: str) -> bytearray:
        """A fresh, writable copy of a blob (numpy arrays restored on it stay writable)."""
        path = self.path(sha)
        data = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as src:
            view = memoryview(data)
            done = 0
            while done < len(data):
                count = src.readinto(view[done:])
                if not count:
                    raise OSError(f"blob {sha} shrank while reading")
                done += count
        return data

    def size(self, ref: Ref) -> int:
        if "inline" in ref:
            return len(base64.b64decode(ref["inline"]))
        return self.path(ref["blob"]).stat().st_size

    def collect(self, keep: Iterable[str]) -> list[str]:
        """Delete blobs (and stray temp files) not in ``keep``; returns what went."""
        wanted = set(keep)
        removed: list[str] = []
        if not self.directory.is_dir():
            return removed
        for entry in os.scandir(self.directory):
            if entry.name in wanted or not entry.is_file():
                continue
            if SHA256_HEX.fullmatch(entry.name) or entry.name.endswith(".tmp"):
                os.unlink(entry.path)
                removed.append(entry.name)
        return removed


def decode_inline(ref: Ref) -> bytearray:
    return bytearray(base64.b64decode(ref["inline"]))


def blob_shas(refs: Iterable[Ref]) -> set[str]:
    return {ref["blob"] for ref in refs if "blob" in ref}
