"""Disk quotas: each slot's directory is its own small ext4 filesystem.

The agent (as root) gives every slot a loop-mounted ext4 image of the workspace's
disk limit, holding its files, packages, home and ``/tmp``. A write past the limit
fails inside the kernel with ENOSPC and nowhere else.

The images are thin: sparse files that take host disk only as they are written,
so a running workspace costs what it holds, not its limit, and a laptop with a
few GiB free runs many. The sum of the limits may therefore exceed the disk. What
keeps the platform's own disk (the metadata DB, the blobs, the agent's state) is
the reserve: no slot is made while less than ``reserve_bytes`` is free, and a
workspace whose filesystem is nearly full is told (``agent.diskwatch``).

Unprivileged agents cannot mount; they report the quota as missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from typing import Any

from nbfleet.model.errors import Conflict
from nbfleet.model.limits import format_size

log = logging.getLogger(__name__)

#: Free space a slot may never take from the platform's own disk.
DEFAULT_RESERVE_BYTES = 1 << 30
_MKFS = ("-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1")
#: A state filesystem holds a few large files (a manifest, content-addressed blobs).
_FEW_FILES_MKFS = ("-i", str(1 << 20))


def state_disk_bytes(memory_limit: int | None) -> int:
    """The size of a slot's state filesystem, where its kernels write the state a
    suspend, a move or a checkpoint saves. That state is the kernels' memory
    pickled, so no limit on the workspace's files may refuse it: it is sized from
    the slot's memory limit (the host's memory where it has none), twice over, for
    the previous snapshot beside the new. Thin, it costs the host only what is
    written; bounded, a tenant that writes junk there fills only its own."""
    memory = memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 2 * memory + (256 << 20)


class QuotasUnavailable(RuntimeError):
    """Loop-mounted filesystems cannot be made here (not root, or no loop devices)."""


@dataclass(frozen=True, slots=True)
class Disk:
    image: str
    mountpoint: str
    size: int

    def usage(self) -> tuple[int, int]:
        """(bytes used, bytes in all) of the mounted filesystem."""
        stats = os.statvfs(self.mountpoint)
        total = stats.f_blocks * stats.f_frsize
        return total - stats.f_bfree * stats.f_frsize, total

    def remove(self) -> None:
        unmount(self.mountpoint)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.image)


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise OSError(f"{argv[0]} failed: {(result.stderr or result.stdout).strip()[:300]}")


def unmount(mountpoint: str) -> None:
    """Detach at once even if a process still holds a file there (``-l``); the loop
    device frees itself when the last reference goes (``autoclear``)."""
    if os.path.ismount(mountpoint):
        try:
            _run("umount", "-l", mountpoint)
        except OSError as exc:
            log.warning("could not unmount %s: %s", mountpoint, exc)


def mounts_under(directory: str) -> list[str]:
    """Mount points below ``directory``, deepest first."""
    prefix = directory.rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


class LeftoversRemain(RuntimeError):
    """What a killed agent left could not be removed: starting over it would fail
    later, and less clearly."""


def remove_leftovers(directory: str) -> None:
    """Remove ``directory``, a previous boot's, with whatever is mounted below it
    (its slots' disks and socket tmpfs, which a ``kill -9`` leaves mounted).

    Only this agent's own directories are passed here, never a pattern: what is
    unmounted is what lies below them. Raises :class:`LeftoversRemain` naming what
    stayed, instead of leaving a tree that the next ``mkdir`` trips over.
    """
    for point in mounts_under(directory):
        unmount(point)
    still = mounts_under(directory)
    if still:
        raise LeftoversRemain(
            f"cannot unmount what a previous run left under {directory}: {', '.join(still)}"
            " (unmount it by hand, or run the agent as the user that mounted it)")
    if not os.path.lexists(directory):
        return
    try:
        if os.path.isdir(directory) and not os.path.islink(directory):
            shutil.rmtree(directory, onerror=_writable_and_again)
        else:
            os.unlink(directory)
    except OSError as exc:
        raise LeftoversRemain(f"cannot remove what a previous run left at {directory}: "
                              f"{exc.strerror or exc} ({exc.filename or directory})") from exc


def _writable_and_again(_function: Any, path: str, _info: Any) -> None:
    """A tenant's kernel may have made a directory of its own unwritable (an
    unprivileged agent's kernels are its own uid): the agent, its owner, makes it
    writable again and retries, or a ``chmod 0500`` would keep the agent from ever
    starting. Anything else (another user's, a read-only mount) still fails."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(os.path.dirname(path), stat.S_IRWXU)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, stat.S_IRWXU)
            shutil.rmtree(path, onerror=_writable_and_again)
        else:
            os.unlink(path)


class DiskQuotas:
    def __init__(self, images_dir: str, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        self.images_dir = images_dir
        self.reserve_bytes = reserve_bytes

    @classmethod
    def open(cls, images_dir: str, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> DiskQuotas:
        """Check, with a real mount, that quotas work here."""
        if os.geteuid() != 0:
            raise QuotasUnavailable("disk quotas need root (loop-mounted filesystems)")
        if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
            raise QuotasUnavailable("disk quotas need mkfs.ext4 and mount (e2fsprogs, "
                                    "util-linux)")
        quotas = cls(images_dir, reserve_bytes)
        os.makedirs(images_dir, mode=0o700, exist_ok=True)
        probe = os.path.join(images_dir, "probe")
        try:
            quotas.create("probe", probe, 16 << 20).remove()
        except OSError as exc:
            raise QuotasUnavailable(f"cannot loop-mount a filesystem here: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(probe)
        return quotas

    def create(self, name: str, mountpoint: str, size: int, few_files: bool = False) -> Disk:
        """A fresh, thin filesystem of ``size`` bytes mounted at ``mountpoint``
        (the caller checks the reserve first: :meth:`check_reserve`).
        ``few_files``: a kernel's state (a manifest and large blobs)."""
        image = os.path.join(self.images_dir, f"{name}.img")
        os.makedirs(mountpoint, exist_ok=True)
        disk = Disk(image, mountpoint, size)
        try:
            fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            _run("mkfs.ext4", *_MKFS, *(_FEW_FILES_MKFS if few_files else ()), image)
            # noinit_itable: ext4 would otherwise zero every inode table in the
            # background after the mount, writing a sparse image out for nothing.
            _run("mount", "-o", "loop,nosuid,nodev,noatime,noinit_itable", image, mountpoint)
        except BaseException:
            disk.remove()
            raise
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(mountpoint, "lost+found"))
        return disk

    def short(self) -> tuple[bool, int]:
        """Whether the host's free disk is below the reserve, and how much is free."""
        free = shutil.disk_usage(self.images_dir).free
        return free < self.reserve_bytes, free

    def check_reserve(self) -> None:
        """Refuse a new slot while the host's free disk is below the reserve: what
        kernels write could otherwise fill the disk the platform runs on."""
        short, free = self.short()
        if short:
            raise Conflict(
                f"this host is short of disk for another workspace: {format_size(free)} "
                f"free, and {format_size(self.reserve_bytes)} stay reserved for the "
                "platform")

    def small_tmpfs(self, mountpoint: str, uid: int, size: str = "1m") -> bool:
        """A tiny tmpfs owned by ``uid`` at ``mountpoint`` (a socket directory)."""
        os.makedirs(mountpoint, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700,uid={uid},gid={uid},"
             "nosuid,nodev,noexec", "tmpfs", mountpoint)
        return True

    def sweep(self) -> None:
        """Delete the disk images a previous boot of this agent left behind (their
        mounts are gone with :func:`remove_leftovers`)."""
        if os.path.isdir(self.images_dir):
            for entry in os.scandir(self.images_dir):
                if entry.name.endswith(".img"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
