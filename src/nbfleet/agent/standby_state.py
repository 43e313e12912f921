"""Loading checkpoints into a standby's kernel, one after another.

The first checkpoint a standby kernel gets is restored as on any resume, into
its fresh namespace. Each later one is applied on top (``nbfleet.kernel.delta``):
only the groups that changed are loaded, so a failover finds the values of the
executor's last checkpointed cell already in memory. Where an apply would not be
exact the kernel says so and changes nothing (``NeedsFresh``); the caller then
loads the checkpoint into a new kernel.

The kernel reads the agent's staged download through hard links, not copies: the
blobs stay the agent's, readable to the kernel through its group and never
writable, because the next stage links them again (a kernel able to change them
would change what its next load verified). Where the kernel runs as the agent's
own uid it could, so there they are copied.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from typing import Any

from nbfleet.agent import statesync
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.restore_report import clean_report
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.snapshots import download_state

APPLY = "__import__('nbfleet.kernel').kernel.apply()"


class NeedsFresh(Exception):
    """The kernel cannot bring its namespace forward to this checkpoint exactly."""


async def load(kernel: KernelProcess, staged: str, first: bool) -> dict[str, Any]:
    """Load the snapshot staged (downloaded and verified) in ``staged``; the report
    (a ``RestoreReport``'s shape). ``first``: the kernel's namespace is fresh."""
    assert kernel.state_dir is not None
    await asyncio.to_thread(_install_linked, kernel, staged)
    code = statesync.restore_code(statesync.replay_budget_s()) if first else APPLY
    await statesync.run_internal(kernel, code, statesync.RESTORE_TIMEOUT_S)
    raw = await asyncio.to_thread(statesync.read_raw_report, kernel.state_dir)
    if "fresh" in raw:
        raise NeedsFresh(str(raw["fresh"])[:300])
    return clean_report(raw)


async def bring_forward(store: BlobStore, workspace_id: str, kernel: KernelProcess,
                        key: str, reuse: str | None) -> dict[str, Any]:
    """Download snapshot ``key`` (the blobs already staged in ``reuse`` linked, not
    fetched) and apply it on top of what the kernel holds: a promotion asked for
    a later snapshot than the standby's (a suspend's, made after its last cell's
    checkpoint), which mostly holds the same values. NeedsFresh as for :func:`load`."""
    assert kernel.staging_root is not None
    directory = os.path.join(kernel.staging_root, f".promote-{uuid.uuid4().hex[:12]}")
    os.mkdir(directory, 0o700)
    try:
        await asyncio.to_thread(download_state, store, workspace_id, key, directory, reuse)
        return await load(kernel, directory, first=False)
    finally:
        await asyncio.to_thread(shutil.rmtree, directory, True)


def _install_linked(kernel: KernelProcess, staged: str) -> None:
    assert kernel.staging_root is not None and kernel.state_dir is not None
    identity = kernel.manager.identity
    staging = os.path.join(kernel.staging_root, f".standby-load-{uuid.uuid4().hex[:12]}")
    os.mkdir(staging, 0o755)
    try:
        os.mkdir(os.path.join(staging, "blobs"), 0o755)
        with os.scandir(os.path.join(staged, "blobs")) as blobs:
            for blob in blobs:
                target = os.path.join(staging, "blobs", blob.name)
                if identity is not None:
                    os.link(blob.path, target)
                    # The agent's files are owner-only (its umask): readable to the
                    # kernel through its group, never writable (the inode is the
                    # agent's staged blob, linked again at the next stage).
                    os.chown(target, -1, identity.gid)
                    os.chmod(target, 0o440)
                else:
                    shutil.copyfile(blob.path, target)
        shutil.copyfile(os.path.join(staged, "manifest.json"),
                        os.path.join(staging, "manifest.json"))
        if identity is not None:
            # The directories and the manifest become the kernel's (it writes its
            # own snapshots there once promoted); the linked blobs stay the agent's.
            # Done here, where the kernel cannot reach yet.
            for path in (staging, os.path.join(staging, "blobs"),
                         os.path.join(staging, "manifest.json")):
                os.chown(path, identity.uid, identity.gid, follow_symlinks=False)
        else:
            kernel.own(staging)
        statesync.put_in_place(kernel, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
