"""Moving a kernel's in-memory state between the kernel, its slot and the blob store.

The kernel's extension (``nbfleet.kernel``) writes and reads the state in the
kernel's own state directory; it never touches the blob store, which the sandbox
hides. The agent asks it to flush or restore through a silent execute request, then
copies the directory to or from the store (``nbfleet.storage.snapshots``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from nbfleet.agent import preimports
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.restore_report import clean_report, describe
from nbfleet.model.errors import SuspendFailed
from nbfleet.storage import beneath
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.snapshots import CorruptSnapshot, download_state, upload_state

log = logging.getLogger(__name__)

FLUSH = "__import__('nbfleet.kernel').kernel.flush()"
FLUSH_TIMEOUT_S = 300.0
#: A backstop only: re-running cells is bounded inside the kernel (REPLAY_BUDGET_ENV);
#: what is left is loading values, and code that never yields to a signal.
RESTORE_TIMEOUT_S = 300.0
INTERRUPT_GRACE_S = 10.0
REPORT_LIMIT = 64 << 20
#: A backstop for the imports done while a snapshot downloads (the restore waits on them).
PREIMPORT_TIMEOUT_S = 120.0
#: Seconds all replays of one kernel may take on resume (the kernel stops them).
REPLAY_BUDGET_ENV = "NBFLEET_REPLAY_BUDGET_S"
DEFAULT_REPLAY_BUDGET_S = 10.0


def replay_budget_s() -> float:
    try:
        value = float(os.environ.get(REPLAY_BUDGET_ENV, DEFAULT_REPLAY_BUDGET_S))
    except ValueError:
        return DEFAULT_REPLAY_BUDGET_S
    return value if value > 0 else DEFAULT_REPLAY_BUDGET_S


def restore_code(budget_s: float) -> str:
    return ("__import__('importlib').invalidate_caches()\n"
            f"__import__('nbfleet.kernel').kernel.restore(replay_budget_s={budget_s!r})")

OnBusy = Literal["wait", "interrupt"]


class KernelFailed(Exception):
    """The kernel answered the agent's request with an error."""


@dataclass(frozen=True, slots=True)
class SuspendOptions:
    """What to do with a cell still running when a suspend arrives.

    ``wait``: give the cell ``busy_timeout_s`` to finish, then interrupt it.
    ``interrupt``: interrupt it at once. Either way the state captured is the one
    after the cell stopped; a kernel that ignores the interrupt fails the suspend,
    and the workspace keeps running.
    """

    on_busy: OnBusy = "wait"
    busy_timeout_s: float = 30.0


async def quiesce(kernel: KernelProcess, options: SuspendOptions) -> str | None:
    """Make sure no cell runs; returns a note for the user when one was interrupted."""
    if kernel.execution_state in ("idle", "dead"):
        return None
    if options.on_busy == "wait" and await kernel.wait_idle(options.busy_timeout_s):
        return None
    await kernel.interrupt()
    if not await kernel.wait_idle(INTERRUPT_GRACE_S):
        raise SuspendFailed(f"kernel {kernel.id} is still busy after an interrupt", runtime="kept")
    return "a running cell was interrupted to suspend"


async def run_internal(kernel: KernelProcess, code: str, timeout_s: float) -> None:
    reply = await kernel.execute_internal(code, timeout_s)
    if reply.get("status") != "ok":
        raise KernelFailed(f"{reply.get('ename', 'error')}: {reply.get('evalue', '')}"[:500])


class FlushFailed(Exception):
    """A kernel holds state and could not write it: saving without it would lose
    every variable while the suspend said it succeeded."""


async def flush(kernel: KernelProcess) -> bool:
    """Have the kernel write its state to its state directory. False: it has none
    to write (not an IPython kernel, or its process died); :class:`FlushFailed`
    when it could not write what it holds."""
    if kernel.state_dir is None or kernel.execution_state == "dead":
        return False
    try:
        await run_internal(kernel, FLUSH, FLUSH_TIMEOUT_S)
    except (KernelFailed, TimeoutError) as exc:
        why = str(exc) or f"it did not answer within {FLUSH_TIMEOUT_S:.0f} s"
        log.warning("kernel %s could not flush its state: %s", kernel.id, why)
        raise FlushFailed(f"kernel {kernel.id} could not write its variables: {why}") from exc
    manifest = os.path.join(kernel.state_dir, "manifest.json")
    if not await asyncio.to_thread(os.path.exists, manifest):
        raise FlushFailed(f"kernel {kernel.id} wrote no state")
    return True


def upload(store: BlobStore, workspace_id: str, kernel: KernelProcess,
           known: set[str] | None = None) -> dict[str, Any]:
    assert kernel.state_dir is not None
    uploaded = upload_state(store, workspace_id, kernel.id, kernel.state_dir, known)
    return {"key": uploaded.key, "bytes": uploaded.bytes_total, "written": uploaded.bytes_written}


async def restore(store: BlobStore, workspace_id: str, kernel: KernelProcess,
                  key: str | None, path: str, prepared: frozenset[str] = frozenset(),
                  preimport: tuple[str, ...] = (), staged: str | None = None,
                  reuse: str | None = None) -> dict[str, Any]:
    """Load a snapshot into a started kernel; the report says what came back.

    A snapshot that fails verification, or that the kernel cannot read, is not
    loaded at all: the kernel keeps an empty namespace and the report says that
    only the files were restored. ``preimport``: modules (``preimports.needs``) the
    kernel imports while the snapshot downloads; ``prepared``: those a warm kernel
    imported before it was claimed. The report lists those that did load.
    ``staged``: ``key`` already downloaded and verified there by the agent (a
    standby's), moved into place instead of downloaded; ``reuse``: an older such
    download, whose blobs are linked rather than fetched again.
    """
    started = time.perf_counter()
    report = _report(path)
    if key is not None and kernel.state_dir is not None:
        importing = (asyncio.create_task(_preimport(kernel, prepared, preimport))
                     if prepared or preimport else None)
        try:
            try:
                report["bytes"] = await asyncio.to_thread(_install, store, workspace_id, key,
                                                          kernel, staged, reuse)
            finally:
                if importing is not None:
                    report.update(await importing)
            await run_internal(kernel, restore_code(replay_budget_s()), RESTORE_TIMEOUT_S)
            report.update(await asyncio.to_thread(_read_report, kernel.state_dir))
        except TimeoutError:  # an OSError too: before the clause that calls it corrupt
            report.update(await _stop_restore(kernel))
        except (CorruptSnapshot, KernelFailed, ValueError, OSError) as exc:
            log.warning("snapshot %s of %s is unusable: %s", key, workspace_id, exc)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_install, None, workspace_id, None, kernel)
            report.update(files_only=True, error=f"corrupt snapshot: {exc}"[:500])
    report["seconds"] = round(time.perf_counter() - started, 4)
    message = describe(report)
    if message:
        kernel.announce(message)
    return report


def report_loaded(kernel: KernelProcess, path: str, body: dict[str, Any], preloaded: bool,
                  seconds: float) -> dict[str, Any]:
    """The report of a state a standby loaded (``standby_state``), told to the
    notebook as a restore's is. ``preloaded``: before it was promoted."""
    report = {**_report(path), **body, "seconds": round(seconds, 4), "preloaded": preloaded}
    message = describe(report)
    if message:
        kernel.announce(message)
    return report


def _report(path: str) -> dict[str, Any]:
    return {"path": path, "restored": [], "changed": [], "recomputed": [], "lost": [],
            "settings": [], "files_only": False, "error": None}


async def preimport(kernel: KernelProcess, modules: tuple[str, ...]) -> list[str]:
    """Import ``modules`` in the kernel ahead of a restore; those that loaded."""
    return (await _preimport(kernel, frozenset(), modules)).get("preimported", [])


async def _preimport(kernel: KernelProcess, prepared: frozenset[str],
                     wanted: tuple[str, ...]) -> dict[str, list[str]]:
    """Import ``wanted`` in the kernel; which of them, and of ``prepared``, are loaded."""
    asked = sorted(name for name in {*prepared, *wanted} if preimports.DOTTED.fullmatch(name))
    loaded = f"' '.join(sorted(set({asked!r}) & set(__import__('sys').modules)))"
    try:
        reply = await kernel.execute_internal(preimports.preimport_code(wanted),
                                              PREIMPORT_TIMEOUT_S, {"loaded": loaded})
        text = reply["user_expressions"]["loaded"]["data"]["text/plain"]
    except Exception as exc:  # a head start only: the restore imports them anyway
        log.warning("kernel %s: importing %s ahead failed: %r", kernel.id, asked, exc)
        return {}
    names = set(str(text).strip("'\"").split()) & set(asked)
    out = {"prepared": sorted(names & prepared),
           "preimported": sorted(names & set(wanted) - prepared)}
    return {field: value for field, value in out.items() if value}


async def _stop_restore(kernel: KernelProcess) -> dict[str, Any]:
    """The restore outran RESTORE_TIMEOUT_S: interrupt it so the resume goes on.

    Interrupted while re-running cells, the kernel keeps what it loaded and writes
    its report (the rest is reported lost); interrupted earlier it has loaded
    nothing. A kernel that ignores the interrupt is restarted, empty.
    """
    assert kernel.state_dir is not None
    log.warning("restore in kernel %s took longer than %.0f s; interrupting it",
                kernel.id, RESTORE_TIMEOUT_S)
    await kernel.interrupt()
    if await kernel.wait_idle(INTERRUPT_GRACE_S):
        with contextlib.suppress(OSError, ValueError):
            return await asyncio.to_thread(_read_report, kernel.state_dir)
        return {"files_only": True,
                "error": f"restoring the variables took longer than {RESTORE_TIMEOUT_S:.0f} s "
                         "and was stopped"}
    await kernel.restart()
    return {"files_only": True,
            "error": f"restoring the variables took longer than {RESTORE_TIMEOUT_S:.0f} s; "
                     "the kernel did not stop and was restarted"}


def _install(store: BlobStore | None, workspace_id: str, key: str | None,
             kernel: KernelProcess, staged: str | None = None,
             reuse: str | None = None) -> int:
    """Put a snapshot (None: nothing) in place as the kernel's state directory.

    The kernel owns its state directory and may already run code (a
    ``sitecustomize`` in its package layer), so the snapshot is downloaded where it
    cannot reach (beside the slot's root, the agent's), then renamed into place:
    the agent never writes through a link the kernel planted. Returns its size.
    """
    assert kernel.state_dir is not None and kernel.staging_root is not None
    staging = staged or os.path.join(kernel.staging_root, f".restore-{uuid.uuid4().hex[:12]}")
    if staged is None:
        os.mkdir(staging, 0o755)
    try:
        size = 0
        if staged is not None:
            size = _size(staged)
        elif store is not None and key is not None:
            size = download_state(store, workspace_id, key, staging, reuse)
        put_in_place(kernel, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    kernel.own(kernel.state_dir)
    return size


def put_in_place(kernel: KernelProcess, staging: str) -> None:
    """Rename ``staging`` (the agent's, beside the slot) over the kernel's state
    directory, whatever the kernel left there (removed, never followed)."""
    assert kernel.state_dir is not None
    parent, name = os.path.split(kernel.state_dir)
    with beneath.directory(parent) as folder:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=folder)
            else:
                os.unlink(name, dir_fd=folder)
        os.rename(staging, name, dst_dir_fd=folder)


def _size(directory: str) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(os.path.join(directory, "blobs"))
               ) + os.path.getsize(os.path.join(directory, "manifest.json"))


def _read_report(state_dir: str) -> dict[str, Any]:
    """What the kernel wrote about its restore, in the protocol's shape."""
    return clean_report(read_raw_report(state_dir))


def read_raw_report(state_dir: str) -> dict[str, Any]:
    """What the kernel wrote about its restore. ValueError if it is not a report at
    all."""
    return read_kernel_json(state_dir, "restore-report.json", REPORT_LIMIT,
                            "the restore report")


def read_kernel_json(state_dir: str, name: str, limit: int, what: str) -> dict[str, Any]:
    """A JSON object the kernel wrote in its state directory (it owns the file: read
    through a checked descriptor, bounded). ValueError, naming ``what``, if it is
    missing, too large or not a JSON object."""
    with beneath.directory(state_dir) as folder, \
            beneath.open_regular(folder, name) as opened:
        raw = beneath.read_fd(opened[0], limit) if opened else None
    if raw is None:
        raise ValueError(f"{what} is missing or too large")
    try:
        body = json.loads(raw)
    except RecursionError:  # nested past the parser's stack: not a ValueError
        raise ValueError(f"{what} is nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError(f"{what} is not a JSON object")
    return body


