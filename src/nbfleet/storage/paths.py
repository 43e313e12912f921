"""Workspace-relative paths: the one gate every file path passes through."""

from __future__ import annotations

from nbfleet.model.errors import InvalidInput

MAX_PATH_LENGTH = 1024
#: The longest name one directory entry may have on Linux filesystems (NAME_MAX),
#: counted in UTF-8 bytes as the kernel counts it. A longer segment would make the
#: blob store's write fail with ENAMETOOLONG, so it is refused here, up front.
MAX_SEGMENT_BYTES = 255


def confine(raw: str) -> str:
    """Return ``raw`` as a clean relative POSIX path, or refuse it.

    Refused: empty paths, absolute paths (a leading ``/``: on POSIX ``a:b`` is an
    ordinary name), ``..`` and ``.`` segments, empty segments, backslashes, NUL and
    other control characters, text that is not valid Unicode (lone surrogates), and
    segments longer than :data:`MAX_SEGMENT_BYTES`. Symlinks are refused where files
    are read from a real directory (see ``BlobStore`` and the agent's file sync).
    """
    if not raw or len(raw) > MAX_PATH_LENGTH:
        raise InvalidInput("path must be 1 to 1024 characters", path=raw[:100])
    if raw.startswith("/"):
        raise InvalidInput(f"absolute paths are not allowed: {raw!r}", path=raw)
    if "\\" in raw or any(ord(ch) < 32 or ord(ch) == 127 for ch in raw):
        raise InvalidInput(f"path contains a forbidden character: {raw!r}", path=raw)
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"path is not valid Unicode: {raw!r}", path=repr(raw)) from None
    parts = raw.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise InvalidInput(
                f"path must stay inside the workspace and have no empty, '.' or '..' "
                f"segments: {raw!r}",
                path=raw,
            )
        if len(part.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise InvalidInput(
                f"each name in a path may have at most {MAX_SEGMENT_BYTES} bytes (UTF-8); "
                f"{part[:40]!r}… has {len(part.encode('utf-8'))}",
                path=raw[:100],
            )
    return "/".join(parts)
