"""Workspace-relative paths: the one gate every file path passes through."""

from __future__ import annotations

from nbfleet.model.errors import InvalidInput

MAX_PATH_LENGTH = 1024


def confine(raw: str) -> str:
    """Return ``raw`` as a clean relative POSIX path, or refuse it.

    Refused: empty paths, absolute paths, ``..`` and ``.`` segments, empty segments,
    backslashes, NUL and other control characters. Symlinks are refused where files
    are read from a real directory (see ``BlobStore`` and the agent's file sync).
    """
    if not raw or len(raw) > MAX_PATH_LENGTH:
        raise InvalidInput("path must be 1 to 1024 characters", path=raw[:100])
    if raw.startswith("/") or (len(raw) > 1 and raw[1] == ":"):
        raise InvalidInput(f"absolute paths are not allowed: {raw!r}", path=raw)
    if "\\" in raw or any(ord(ch) < 32 or ord(ch) == 127 for ch in raw):
        raise InvalidInput(f"path contains a forbidden character: {raw!r}", path=raw)
    parts = raw.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise InvalidInput(
                f"path must stay inside the workspace and have no empty, '.' or '..' "
                f"segments: {raw!r}",
                path=raw,
            )
    return "/".join(parts)
