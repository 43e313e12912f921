"""Keep the servers' state readable by their own user only.

``$NBFLEET_HOME`` holds the SQLite DB (token hashes, the ledger), the admin token
and the cluster secret: any local user who reads one of them can act as the
platform. The servers run under umask 077, so whatever they create (and SQLite's
-wal and -shm files, which copy the DB file's mode) is 0600 or 0700; what an
older version left with wider modes is tightened when they start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

#: SQLite's own files beside the DB.
SQLITE_SIDECARS = ("", "-wal", "-shm", "-journal")
#: What nbfleet keeps at the top of ``$NBFLEET_HOME``.
HOME_ENTRIES = (*(f"nbfleet.db{suffix}" for suffix in SQLITE_SIDECARS), "admin-token",
                "cluster-secret", "url", "blobs", "agent")


def restrict_umask() -> None:
    """Owner-only modes for every file and directory this process creates from now."""
    os.umask(0o077)


def tighten(path: Path) -> None:
    """Drop the group and other bits of ``path`` (never following a symlink)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        return
    mode = stat.S_IMODE(info.st_mode)
    if not mode & 0o077:
        return
    if stat.S_ISDIR(info.st_mode) and mode & stat.S_ISVTX:
        # A shared directory such as /tmp: tightening it would break the host.
        log.warning("%s is a shared directory; keep nbfleet's state in a private --home",
                    path)
        return
    try:
        os.chmod(path, mode & ~0o077)
    except PermissionError:
        log.warning("cannot make %s private (mode %04o): it belongs to another user",
                    path, mode)
        return
    log.warning("made %s private (it was mode %04o)", path, mode)


def secure_home(home: Path, create: bool = True) -> None:
    """``home`` (made if ``create``) 0700, and what nbfleet keeps in it 0600 or 0700.

    Only nbfleet's own entries are touched, never the rest of a directory someone
    pointed ``--home`` at, and not recursively: a private home keeps everything
    below out of other users' reach, and the agent's runtimes can hold many files.
    """
    if create:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif not home.is_dir():
        return
    tighten(home)
    for name in HOME_ENTRIES:
        tighten(home / name)


def secure_sqlite(db_url: str) -> None:
    """A SQLite DB given by URL (perhaps outside the home), with its sidecar files."""
    if not db_url.startswith("sqlite"):
        return
    with contextlib.suppress(Exception):  # an unusual URL: SQLite itself will complain
        database = make_url(db_url).database
        if database and database != ":memory:":
            for suffix in SQLITE_SIDECARS:
                tighten(Path(database + suffix))
