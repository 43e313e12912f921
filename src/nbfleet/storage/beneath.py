"""Files in a tree that someone else controls, handled by a more privileged process.

A kernel owns the directories of its slot (its files, packages, state) and can
plant a symbolic link, or swap a directory for one, at any moment; the agent
reads and writes there as root (or as the same user as the control plane's
home). So every path below such a root is resolved one component at a time from
a directory file descriptor, never following a link (``O_NOFOLLOW``), and a file
is used only through the descriptor that was checked: a link planted before or
during the operation makes it fail, never reach outside.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator, Sequence

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 20

Owner = tuple[int, int] | None


@contextlib.contextmanager
def directory(root: str, parts: Sequence[str] = (), create: bool = False,
              owner: Owner = None) -> Iterator[int]:
    """A descriptor of ``root/parts...``; with ``create``, missing directories are
    made (and given to ``owner``). A link anywhere below ``root`` raises OSError."""
    fd = os.open(root, _DIR)
    try:
        for part in parts:
            made = False
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            child = os.open(part, _DIR, dir_fd=fd)
            if made and owner is not None:
                os.fchown(child, *owner)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _split(relative: str) -> tuple[list[str], str]:
    parts = [p for p in relative.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"not a relative path: {relative!r}")
    return parts[:-1], parts[-1]


def write(root: str, relative: str, data: bytes, owner: Owner = None) -> os.stat_result:
    """Write ``root/relative`` atomically (a temporary file renamed over it) and give
    it to ``owner``; returns its stat."""
    parents, name = _split(relative)
    with directory(root, parents, create=True, owner=owner) as parent:
        tmp = f".nbfleet-tmp-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                if owner is not None:
                    os.fchown(handle.fileno(), *owner)
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
        return os.stat(name, dir_fd=parent, follow_symlinks=False)


def unlink(root: str, relative: str) -> None:
    """Remove the file (or link) ``root/relative``; a missing one is no error."""
    parents, name = _split(relative)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), \
            directory(root, parents) as parent:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)


@contextlib.contextmanager
def open_regular(dir_fd: int, name: str) -> Iterator[tuple[int, os.stat_result] | None]:
    """The descriptor and stat of a regular file (None for a link, a device, a fifo
    or anything else that is not one), opened without following a link."""
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError:
        yield None
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            yield None
            return
        os.set_blocking(fd, True)
        yield fd, st
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes | None:
    """At most ``limit`` bytes from ``fd``; None if there are more."""
    chunks, size = [], 0
    while chunk := os.read(fd, min(_CHUNK, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None
    return b"".join(chunks)


def fd_path(fd: int) -> str:
    """A path that opens exactly this descriptor's file, for APIs that want a path
    (``/proc/self/fd/N`` is the open file itself, not the name it had)."""
    return f"/proc/self/fd/{fd}"


def files(root: str, skip_dirs: frozenset[str] = frozenset()) -> Iterator[tuple[str, int, str]]:
    """(relative path, directory descriptor, name) of every entry that is not a
    directory below ``root``, links never followed (``os.fwalk`` checks each
    directory it enters is the one it listed)."""
    if not os.path.isdir(root) or os.path.islink(root):
        return
    for dirpath, dirs, names, dir_fd in os.fwalk(root, follow_symlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
        for name in sorted(names):
            relative = os.path.relpath(os.path.join(dirpath, name), root)
            yield relative.replace(os.sep, "/"), dir_fd, name


def chown_tree(root: str, owner: Owner) -> None:
    """Give ``root`` and everything below it to ``owner``, links themselves included
    but never followed."""
    if owner is None:
        return
    uid, gid = owner
    fd = os.open(root, _DIR)
    try:
        os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    for _dirpath, dirs, names, dir_fd in os.fwalk(root, follow_symlinks=False):
        for name in (*dirs, *names):
            with contextlib.suppress(FileNotFoundError):
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
