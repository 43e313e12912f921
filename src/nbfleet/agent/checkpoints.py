"""After each cell, the kernel's state reaches the blob store (``--cell-checkpoints``).

A host lost between two suspends otherwise loses every variable. So after each
client cell's ``execute_reply`` (off the reply path: the user already has the
answer) the agent has the kernel flush its state and uploads it, then reports the
key to the control plane, which records it as the kernel's latest state. A
placement after a lost host restores from it: the last completed cell's state.

What it costs the user: nothing on the reply path, and almost nothing on the next
cell's. The agent's request is a silent execute that only queues the snapshot on
the capture extension's own thread (``kernel.checkpoint``); that thread pickles and
checks the namespace (exactly, as a suspend does) while the kernel is idle, and a
cell that starts meanwhile makes it give up, so the next cell never waits for it.
The upload sends only blobs the store lacks (content-addressed). The request is
sent only when no client cell waits in the kernel. ``bench/replicas.py`` measures
what remains.

A checkpoint that cannot be taken (the kernel could not write its state, the
store refused it) is not a silent gap: the agent says so in the cell's output
(once, until one succeeds again) and reports it, so the workspace's
``last_error`` and ``snapshot.checkpoint_failures`` say which cell it is behind and
why; the next checkpoint that is kept clears both.

Cells quicker than a checkpoint are coalesced: one checkpoint covers them all.
One task per kernel reports in order, so a report never replaces a later one.

A restart of the kernel's process (its user's, or the agent's after a crash)
empties its namespace on purpose: the same task then reports that it holds
nothing (a report with no key), so a lost host does not bring back the variables
the restart cleared. A checkpoint of the old process still being taken gives up
(the restart fails its request; ``restarts`` is checked before the upload and
before the report). One already being reported is let finish, not cancelled: a
request cut off may still be recorded, after the reset. The reset follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Histogram

from nbfleet.agent import statesync
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.protocol.checkpoints import CheckpointRecorded
from nbfleet.storage.blobs import BlobStore

log = logging.getLogger(__name__)

CHECKPOINT_SECONDS = Histogram(
    "nbfleet_cell_checkpoint_seconds",
    "From a cell's execute_reply to its state being in the blob store and recorded",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CHECKPOINT_BYTES = Counter("nbfleet_cell_checkpoint_bytes_written_total",
                           "Bytes cell checkpoints wrote to the blob store (new blobs only)")
CHECKPOINTS = Counter("nbfleet_cell_checkpoints_total", "Cell checkpoints, by outcome",
                      ["outcome"])

#: The execution count the kernel will give its next cell, read with the request.
COUNT = "get_ipython().execution_count"
#: Asks the kernel's capture worker for a snapshot; the next cell never waits for it.
CHECKPOINT = "__import__('nbfleet.kernel').kernel.checkpoint({seq})"
CHECKPOINT_MARK = "checkpoint.json"
MARK_LIMIT = 64 << 10
#: How long after a reply a checkpoint waits for a next cell (back to back).
SETTLE_S = 0.01
#: How often the agent looks whether the kernel has written its checkpoint.
MARK_POLL_S = 0.005
REQUEST_TIMEOUT_S = 10.0
#: How long a teardown waits for a cancelled checkpoint to end.
FORGET_WAIT_S = 1.0

#: (workspace id, generation, kernel id, the upload, its cell) -> the control plane's answer.
Report = Callable[[str, int, str, dict[str, Any], int], Awaitable[CheckpointRecorded]]


@dataclass(eq=False)
class _Due:
    kernel: KernelProcess
    #: A cell ended since the last checkpoint began.
    dirty: bool = True
    task: asyncio.Task[None] | None = None
    #: Checkpoints this agent uploaded that the control plane may still name.
    ours: set[str] = field(default_factory=set)
    #: Blob digests known to be in the store (not asked again).
    known: set[str] = field(default_factory=set)
    #: The last upload, and its manifest's content digest (``_content_digest``).
    last: dict[str, Any] | None = None
    content: str | None = None
    #: The kernel went away (``Checkpointer.forget``): nothing more is uploaded.
    gone: bool = False
    #: Its process was restarted since the last report, in the runtime of this
    #: generation: "nothing saved" is due. None: no reset due.
    reset: int | None = None
    #: The last checkpoint failed (the user was told; told again only after one
    #: succeeds and another fails).
    failing: bool = False


@dataclass(frozen=True, slots=True)
class Done:
    """One checkpoint, for ``on_done`` (tests and the benchmark read these)."""

    kernel_id: str
    #: 0 and key None: the report of a restart (nothing saved).
    cell: int
    key: str | None
    kept: bool
    #: From the cell's execute_reply to the control plane's answer.
    seconds: float
    #: Why it could not be taken (key None then).
    failed: str | None = None


@dataclass(frozen=True, slots=True)
class _Flushed:
    #: The last cell the state written includes; None: nothing written.
    cell: int | None = None
    #: Why nothing was written, when that is a failure (not a cell starting first,
    #: nor a restart of the process that was asked).
    failure: str | None = None


class Checkpointer:
    """``lock``: the workspace's (suspends and file syncs take it too);
    ``generation``: the generation of the kernel's runtime, or None once it is gone."""

    def __init__(self, blobs: BlobStore, lock: Callable[[str], asyncio.Lock],
                 generation: Callable[[KernelProcess], int | None], report: Report) -> None:
        self.blobs = blobs
        self.lock = lock
        self.generation = generation
        self.report = report
        self.on_done: Callable[[Done], None] = lambda done: None
        self._due: dict[KernelProcess, _Due] = {}
        self._seq = 0

    def watch(self, kernel: KernelProcess) -> None:
        kernel.on_cell_done = self.cell_done
        kernel.on_restart = self.restarted

    def cell_done(self, kernel: KernelProcess) -> None:
        self._due_of(kernel).dirty = True
        self._start(kernel)

    def restarted(self, kernel: KernelProcess) -> None:
        """The kernel's process was replaced: what was saved of the old one must not
        come back after a lost host. Reported by the kernel's one task, after any
        report of the old process already on its way, so it is never overtaken."""
        generation = self.generation(kernel)
        if generation is None:
            # Not serving its runtime (yet): a restart while it is placed, before its
            # restore, clears nothing of the user's (the placing agent's own).
            return
        due = self._due_of(kernel)
        due.reset = generation
        due.dirty = False  # the old process's cells: nothing of theirs is left
        self._start(kernel)

    def _due_of(self, kernel: KernelProcess) -> _Due:
        due = self._due.get(kernel)
        if due is None:
            due = self._due[kernel] = _Due(kernel, dirty=False)
        return due

    def _start(self, kernel: KernelProcess) -> None:
        due = self._due[kernel]
        if due.task is None or due.task.done():
            due.task = asyncio.create_task(self._run(due, time.perf_counter()),
                                           name=f"checkpoint-{kernel.id}")

    async def forget(self, kernel: KernelProcess) -> None:
        """The kernel is going away (the caller holds the workspace's lock).

        The wait is bounded: a task that missed its cancellation and now waits
        for that lock would never end (a release hung on it for good). It finds
        ``gone`` set once it has the lock, and does nothing."""
        kernel.on_cell_done = lambda kernel: None
        kernel.on_restart = lambda kernel: None
        due = self._due.pop(kernel, None)
        if due is not None and due.task is not None:
            due.gone = True
            due.task.cancel()
            _, pending = await asyncio.wait({due.task}, timeout=FORGET_WAIT_S)
            if pending:
                log.warning("checkpoint of kernel %s did not stop when asked", kernel.id)

    async def _run(self, due: _Due, since: float) -> None:
        kernel = due.kernel
        # A client running cells back to back sends the next one within milliseconds
        # of a reply: its reply starts the checkpoint covering both, instead of this
        # one's request going ahead of it in the kernel's queue.
        await asyncio.sleep(SETTLE_S)
        while due.reset is not None or due.dirty:
            if due.reset is not None:  # first: a checkpoint of the new process replaces it
                generation, due.reset = due.reset, None
                try:
                    await self._reset(due, generation, since)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the control plane down: the next cell's
                    CHECKPOINTS.labels("failed").inc()  # checkpoint replaces the old
                    log.warning("reset of kernel %s not reported: %r", kernel.id, exc)
                since = time.perf_counter()
                continue
            if kernel.cells_pending:  # the next cell's reply starts the one covering both
                return
            due.dirty = False
            try:
                await self._checkpoint(due, since)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store or the control plane down: next cell's
                CHECKPOINTS.labels("failed").inc()
                log.warning("checkpoint of kernel %s failed: %r", kernel.id, exc)
            since = time.perf_counter()

    async def _reset(self, due: _Due, generation: int, since: float) -> None:
        """Report that the kernel holds nothing: its process was restarted in the
        runtime of ``generation``."""
        kernel = due.kernel
        if due.gone or self.generation(kernel) != generation:
            return  # it left that runtime: a suspend or a move saved its state
        # The new process's first snapshot may equal the old one's last (the same
        # cells run again), whose manifest this reset has the agent delete.
        due.content = due.last = None
        recorded = await self.report(kernel.workspace_id, generation, kernel.id,
                                     {"key": None, "bytes": 0, "written": 0}, 0)
        if recorded.kept:
            if recorded.replaced in due.ours:
                due.ours.discard(recorded.replaced)
                await asyncio.to_thread(self._delete, recorded.replaced)
        else:
            log.info("reset of kernel %s not kept: %s", kernel.id, recorded.reason)
        CHECKPOINTS.labels("reset" if recorded.kept else "refused").inc()
        self.on_done(Done(kernel.id, 0, None, recorded.kept,
                          round(time.perf_counter() - since, 6)))

    async def _checkpoint(self, due: _Due, since: float) -> None:
        kernel = due.kernel
        workspace_id = kernel.workspace_id
        generation = self.generation(kernel)
        if generation is None or kernel.execution_state == "dead":
            return
        if kernel.cells_pending:  # one came meanwhile: its reply starts the next
            due.dirty = True
            return
        restarts = kernel.restarts
        # The kernel writes the snapshot on its own thread: nothing of the agent's
        # waits meanwhile (a suspend, an API write), only this task.
        self._seq += 1
        flushed = await _flush(kernel, self._seq)
        if flushed.failure is not None:
            await self._failed(due, generation, flushed.cell or 0, flushed.failure, since)
            return
        cell = flushed.cell
        if cell is None:
            if kernel.cells_pending:
                due.dirty = True  # abandoned for the next cell: its reply tries again
            return
        failure: str | None = None
        async with self.lock(workspace_id):
            if (due.gone or self.generation(kernel) != generation
                    or kernel.execution_state == "dead"):
                return  # suspended, moved or released meanwhile: it saved its own state
            if kernel.restarts != restarts:
                return  # the old process's state: the restart's reset replaces it
            assert kernel.state_dir is not None
            content = await asyncio.to_thread(_content_digest, kernel.state_dir)
            reused = content is not None and content == due.content and due.last is not None
            if reused and due.last is not None:
                saved = dict(due.last)  # nothing changed: the same snapshot, a later cell
            else:
                try:
                    saved = await asyncio.to_thread(statesync.upload, self.blobs,
                                                    workspace_id, kernel, due.known)
                except Exception as exc:  # the store refused it, or the state is unreadable
                    failure = f"could not upload it: {exc!r}"[:500]
                else:
                    if kernel.restarts != restarts:  # restarted while it uploaded
                        await asyncio.to_thread(self._delete, str(saved["key"]))
                        return
                    due.content, due.last = content, dict(saved, written=0)
        if failure is not None:
            await self._failed(due, generation, cell, failure, since)
            return
        key = str(saved["key"])
        # Not deleted if this fails: the control plane may have kept it.
        recorded = await self.report(workspace_id, generation, kernel.id, saved, cell)
        if recorded.kept:
            due.ours.add(key)
            if recorded.replaced in due.ours:
                due.ours.discard(recorded.replaced)
                await asyncio.to_thread(self._delete, recorded.replaced)
        else:
            log.info("checkpoint of kernel %s not kept: %s", kernel.id, recorded.reason)
            if not reused:  # a reused one was kept before, and may still be named
                await asyncio.to_thread(self._delete, key)
        seconds = time.perf_counter() - since
        if recorded.kept:
            due.failing = False
        CHECKPOINTS.labels("kept" if recorded.kept else "refused").inc()
        CHECKPOINT_BYTES.inc(int(saved.get("written", 0)))
        if recorded.kept:
            CHECKPOINT_SECONDS.observe(seconds)
        self.on_done(Done(kernel.id, cell, key, recorded.kept, round(seconds, 6)))

    async def _failed(self, due: _Due, generation: int, cell: int, reason: str,
                      since: float) -> None:
        """Say that the state after ``cell`` was not saved: in the cell's output (once
        per run of failures) and to the control plane (the workspace's last error)."""
        kernel = due.kernel
        CHECKPOINTS.labels("failed").inc()
        log.warning("checkpoint of kernel %s failed: %s", kernel.id, reason)
        if not due.failing:
            due.failing = True
            kernel.warn_in_cell(
                f"nbfleet: the kernel's state after this cell could not be checkpointed "
                f"({reason}). The kernel goes on; if its host is lost, the workspace comes "
                "back as of its last saved state (see the workspace's last_error).\n")
        recorded = await self.report(kernel.workspace_id, generation, kernel.id,
                                     {"key": None, "bytes": 0, "written": 0,
                                      "failed": reason[:1000]}, cell)
        self.on_done(Done(kernel.id, cell, None, recorded.kept,
                          round(time.perf_counter() - since, 6), failed=reason))

    def _delete(self, key: str | None) -> None:
        """Only the manifest: its blobs are content-addressed and may be shared."""
        if key is not None:
            with contextlib.suppress(Exception):
                self.blobs.delete(key)


async def _flush(kernel: KernelProcess, seq: int) -> _Flushed:
    """Have the kernel write its state in the background: the count of the last
    cell it includes, or why it could not (nothing, when a cell started first)."""
    if kernel.state_dir is None:
        return _Flushed()
    restarts = kernel.restarts
    try:
        reply = await kernel.execute_internal(CHECKPOINT.format(seq=seq), REQUEST_TIMEOUT_S,
                                              {"count": COUNT})
    except TimeoutError:
        if kernel.restarts != restarts or kernel.cells_pending:
            # The restart failed it, or a client's cell came first and the request
            # waits behind it: no failure (that cell's reply asks again).
            return _Flushed()
        return _Flushed(failure=f"the kernel did not take the request within "
                                f"{REQUEST_TIMEOUT_S:.0f} s")
    if reply.get("status") != "ok":
        return _Flushed(failure="the kernel refused the request: "
                                + str(reply.get("evalue", ""))[:200])
    cell = _count(reply) - 1
    deadline = time.monotonic() + statesync.FLUSH_TIMEOUT_S
    while time.monotonic() < deadline:
        mark = await asyncio.to_thread(_read_mark, kernel.state_dir)
        if mark is not None and mark.get("seq") == seq:
            if mark.get("ok") is True:
                return _Flushed(cell)
            reason = str(mark.get("reason"))[:500]
            if mark.get("abandoned") is True:
                log.info("checkpoint of kernel %s not taken: %s", kernel.id, reason)
                return _Flushed()
            return _Flushed(cell, failure=f"the kernel could not write it: {reason}")
        if kernel.execution_state == "dead" or kernel.restarts != restarts:
            return _Flushed()  # the process that was asked is gone
        await asyncio.sleep(MARK_POLL_S)
    return _Flushed(cell, failure=f"the kernel did not write it within "
                                  f"{statesync.FLUSH_TIMEOUT_S:.0f} s")


def _content_digest(state_dir: str) -> str | None:
    """What the manifest holds, without its creation time: equal for two snapshots
    of a namespace that did not change (a cell that only printed)."""
    body = _kernel_json(state_dir, "manifest.json", statesync.REPORT_LIMIT)
    if body is None:
        return None
    body.pop("created", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_mark(state_dir: str) -> dict[str, Any] | None:
    """The kernel's note on its last checkpoint; None while there is none."""
    return _kernel_json(state_dir, CHECKPOINT_MARK, MARK_LIMIT)


def _kernel_json(state_dir: str, name: str, limit: int) -> dict[str, Any] | None:
    """A JSON object the kernel wrote in its state directory; None if missing, too
    large or not one (``statesync.read_kernel_json``)."""
    try:
        return statesync.read_kernel_json(state_dir, name, limit, name)
    except (OSError, ValueError):
        return None


def _count(reply: dict[str, Any]) -> int:
    """The kernel's next execution count (user code could make it anything: bounded)."""
    try:
        text = reply["user_expressions"]["count"]["data"]["text/plain"]
        value = int(str(text))
    except (KeyError, TypeError, ValueError):
        return 1
    return min(max(value, 1), 2**31)
