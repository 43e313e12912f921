"""Uploads spooled to disk, so a body of any size costs a bounded amount of memory.

Bytes go to a temporary file in the blob store's staging directory as they arrive,
and are refused (413) as soon as they pass the limit, before the rest is read. The
file becomes a blob only when committed: renamed into place on a local store,
copied by an object store's PUT. Closing an upload that was not committed deletes
the file, so a refused or broken upload leaves nothing behind in the store.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from nbfleet.model.errors import ContentTooLarge
from nbfleet.storage.blobs import BlobStore

#: Pieces in which a committed upload is read back (to mirror it somewhere else).
READ_CHUNK = 1024 * 1024


class Upload:
    """One body on its way into the blob store; use it as a context manager, so the
    temporary file goes whatever happens."""

    def __init__(self, store: BlobStore, limit: int, what: str) -> None:
        self.store = store
        self.limit = limit
        self.what = what
        self.size = 0
        fd, self.path = tempfile.mkstemp(dir=store.staging_dir(), prefix=".tmp-upload-")
        self.file = os.fdopen(fd, "w+b")
        self._moved = False

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def write(self, chunk: bytes | bytearray) -> None:
        """Append ``chunk``; ContentTooLarge (nothing of it written) once past the limit."""
        if self.size + len(chunk) > self.limit:
            raise ContentTooLarge(f"{self.what} is larger than {self.limit} bytes",
                                  limit=self.limit)
        self.file.write(chunk)
        self.size += len(chunk)

    def read(self) -> bytes:
        """The whole body in memory: only for what must parse it (a notebook's schema)."""
        parts = []
        offset = 0
        while offset < self.size:
            part = self.read_chunk(offset, self.size - offset)
            if not part:
                break
            parts.append(part)
            offset += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_chunk(self, offset: int, size: int = READ_CHUNK) -> bytes:
        """``size`` bytes from ``offset`` (empty at the end). It reads the upload's own
        file even after a commit renamed it and a later write replaced the blob."""
        self.file.flush()
        return os.pread(self.file.fileno(), size, offset)

    def commit(self, key: str) -> None:
        """Make the body the blob at ``key``, atomically. The key comes from a user's
        path, so an object store checks it as a filesystem would (``check_tree``)."""
        self.file.flush()
        self.store.put_file(key, self.path, move=self.store.local, check_tree=True)
        self._moved = self.store.local

    def close(self) -> None:
        self.file.close()
        if not self._moved:  # once moved, the name may belong to another upload
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
