"""A throwaway platform for the tests that run it as root and as an unprivileged
user (``hostile.platform_user``): its own directory outside /tmp (which the
unprivileged user must reach), a fresh database, a control plane; the caller
starts its agents. Whatever it mounted is unmounted on the way out."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from nbfleet.agent.sandbox.quota import mounts_under
from tests.conftest import fresh_database
from tests.support.cluster import Cluster
from tests.support.hostile import platform_user


@contextlib.contextmanager
def scratch_dir(mode: str, prefix: str) -> Iterator[tuple[Path, tuple[int, int] | None]]:
    """A directory the platform's user (``mode``) owns, and that user (None: ours)."""
    run_as = platform_user(mode)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    if run_as is not None:
        os.chown(root, *run_as)
    try:
        yield root, run_as
    finally:
        for point in mounts_under(str(root)):  # deepest first
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def platform_as(mode: str, prefix: str) -> Iterator[Cluster]:
    """A control plane run as ``mode``'s user, in a directory of its own."""
    with scratch_dir(mode, prefix) as (root, run_as), fresh_database(root) as url:
        cluster = Cluster(root, url, run_as=run_as)
        try:
            cluster.start_control()
            yield cluster
        finally:
            cluster.stop()
