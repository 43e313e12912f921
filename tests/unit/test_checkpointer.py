"""The agent's cell checkpoints: coalesced, never ahead of a queued cell, and the
manifest of a checkpoint the control plane replaced (or refused) deleted. A restart
of the kernel's process is reported as "nothing saved", after (never before) any
report of the old process, and the old process's state is not reported once it
restarted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nbfleet.agent import checkpoints, statesync
from nbfleet.agent.checkpoints import Checkpointer, Done
from nbfleet.protocol.checkpoints import CheckpointRecorded


class FakeKernel:
    """What the checkpointer reads of a kernel: its queue, and a flush that takes
    ``flush_s`` and reports the next execution count."""

    def __init__(self, state_dir: Path) -> None:
        self.id, self.workspace_id = "k1", "ws1"
        self.state_dir = str(state_dir)
        (state_dir / "manifest.json").write_text("{}")
        self.execution_state = "idle"
        self.cells_pending: set[str] = set()
        self.count = 1
        self.flushes = 0
        self.flush_s = 0.05
        self.on_cell_done: Any = None
        self.on_restart: Any = None
        self.restarts = 0
        self.changes = True
        self.writers: list[asyncio.Task[None]] = []

    async def execute_internal(self, code: str, timeout_s: float,
                               expressions: dict[str, str] | None = None) -> dict[str, Any]:
        """As the kernel's extension: the request returns at once, and the capture
        thread writes the checkpoint later, unless a cell starts first."""
        seq = int(code.rsplit("(", 1)[1].rstrip(")"))
        assert code == checkpoints.CHECKPOINT.format(seq=seq)
        assert expressions == {"count": checkpoints.COUNT}
        self.flushes += 1
        count, restarts = self.count, self.restarts

        async def write() -> None:
            await asyncio.sleep(self.flush_s)
            if self.restarts != restarts:
                return  # the process that was asked is gone
            ok = self.count == count
            if ok:  # the namespace as of that cell (the same, if the cell changed nothing)
                (Path(self.state_dir) / "manifest.json").write_text(json.dumps(
                    {"n": count if self.changes else 0, "created": time.time()}))
            (Path(self.state_dir) / "checkpoint.json").write_text(json.dumps(
                {"seq": seq, "ok": ok, "reason": None if ok else "a cell started"}))
        self.writers.append(asyncio.create_task(write()))
        return {"status": "ok",
                "user_expressions": {"count": {"data": {"text/plain": str(count)}}}}

    def cell(self) -> None:
        """A cell ran and replied."""
        self.count += 1
        self.on_cell_done(self)

    def restart(self) -> None:
        """As ``KernelProcess._restart``: the old process's cells are forgotten, the
        hook runs, and the new process counts from 1 with an empty namespace."""
        self.cells_pending.clear()
        self.restarts += 1
        self.count = 1
        self.on_restart(self)


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           answers: list[CheckpointRecorded], keys: list[str | None] | None = None,
           generation: int | None = 3) -> tuple[FakeKernel, Checkpointer,
                                                list[Done], list[str], list[int]]:
    """``keys`` collects the key of each report (None: a restart's)."""
    kernel = FakeKernel(tmp_path)
    uploads = iter(range(1, 100))
    monkeypatch.setattr(statesync, "upload", lambda store, ws, k, known: {
        "key": f"snap/{next(uploads)}", "bytes": 10, "written": 10})
    deleted: list[str] = []
    reported: list[int] = []

    async def report(ws: str, generation: int, kernel_id: str, saved: dict[str, Any],
                     cell: int) -> CheckpointRecorded:
        reported.append(cell)
        if keys is not None:
            keys.append(saved["key"])
        return answers.pop(0)

    store = SimpleNamespace(delete=deleted.append)
    locks: dict[str, asyncio.Lock] = {}
    keeper = Checkpointer(store, lambda ws: locks.setdefault(ws, asyncio.Lock()),  # type: ignore[arg-type]
                          lambda k: generation, report)
    done: list[Done] = []
    keeper.on_done = done.append
    keeper.watch(kernel)  # type: ignore[arg-type]
    return kernel, keeper, done, deleted, reported


def test_cells_quicker_than_a_checkpoint_are_covered_by_one_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel gives up a checkpoint a cell overtakes (its view may be torn);
    the next one covers every cell so far, and the one before it is replaced."""
    async def main() -> None:
        kernel, _keeper, done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True),
                                    CheckpointRecorded(kept=True, replaced="snap/1")])
        kernel.cell()              # cell 1: its checkpoint is written
        await asyncio.sleep(0.2)
        kernel.cell()              # cell 2: a checkpoint starts (after SETTLE_S)...
        await asyncio.sleep(checkpoints.SETTLE_S + 0.02)
        kernel.cell()              # ...and cell 3 ends before it is written
        await asyncio.sleep(0.4)
        assert kernel.flushes == 3 and reported == [1, 3]
        assert [d.cell for d in done] == [1, 3] and all(d.kept for d in done)
        assert deleted == ["snap/1"]  # ours, replaced: its manifest goes
    asyncio.run(main())


def test_no_flush_is_sent_ahead_of_a_cell_waiting_in_the_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        kernel, keeper, _done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=False, reason="stale")])
        kernel.cells_pending.add("next")  # the client sent the next cell already
        kernel.cell()
        await asyncio.sleep(0.1)
        assert kernel.flushes == 0  # its reply starts the checkpoint covering both
        kernel.cells_pending.clear()
        kernel.cell()
        await asyncio.sleep(0.2)
        assert kernel.flushes == 1 and reported == [2]
        assert deleted == ["snap/1"]  # refused: not named by anyone, deleted
        await keeper.forget(kernel)  # type: ignore[arg-type]
        kernel.cell()  # forgotten: nothing more
        await asyncio.sleep(0.1)
        assert kernel.flushes == 1
    asyncio.run(main())


def test_a_cell_that_changed_nothing_is_recorded_without_an_upload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its snapshot holds what the last one held (only the creation time differs):
    the same key is reported for the later cell, and nothing is sent again."""
    async def main() -> None:
        kernel, _keeper, done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True),
                                    CheckpointRecorded(kept=True),
                                    CheckpointRecorded(kept=True, replaced="snap/1")])
        kernel.changes = False
        kernel.cell()
        await asyncio.sleep(0.2)
        kernel.cell()  # printed something: the namespace is the same
        await asyncio.sleep(0.2)
        kernel.changes = True
        kernel.cell()
        await asyncio.sleep(0.2)
        assert reported == [1, 2, 3]
        assert [d.key for d in done] == ["snap/1", "snap/1", "snap/2"]
        assert deleted == ["snap/1"]
    asyncio.run(main())


def test_a_refused_report_of_an_unchanged_snapshot_keeps_the_manifest_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key was kept before (the workspace may still name it after a suspend
    that could not flush): a refusal of the same key must not delete it."""
    async def main() -> None:
        kernel, _keeper, _done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True),
                                    CheckpointRecorded(kept=False, reason="suspending")])
        kernel.changes = False
        kernel.cell()
        await asyncio.sleep(0.2)
        kernel.cell()
        await asyncio.sleep(0.2)
        assert reported == [1, 2] and deleted == []
    asyncio.run(main())


def test_a_cell_sent_right_after_a_reply_goes_first_and_one_checkpoint_covers_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Back to back: no checkpoint request is queued ahead of the next cell."""
    async def main() -> None:
        kernel, _keeper, _done, _deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True)])
        kernel.cell()
        kernel.cells_pending.add("next")  # the client's next cell, within SETTLE_S
        await asyncio.sleep(checkpoints.SETTLE_S / 4)
        kernel.cells_pending.clear()
        kernel.cell()
        await asyncio.sleep(0.3)
        assert kernel.flushes == 1 and reported == [2]
    asyncio.run(main())


def test_a_checkpoint_that_missed_its_cancellation_does_not_hang_a_teardown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11's ``asyncio.wait_for`` drops a cancel that races its result: the
    task went on to wait for the workspace's lock, which the teardown held while it
    waited for the task (a release hung until the control plane gave up, in CI)."""
    async def main() -> None:
        kernel, keeper, done, _deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True)])
        requested = asyncio.Event()
        answer = kernel.execute_internal

        async def deaf(code: str, timeout_s: float,
                       expressions: dict[str, str] | None = None) -> dict[str, Any]:
            requested.set()
            with contextlib.suppress(asyncio.CancelledError):  # the reply won the race:
                await asyncio.sleep(0.2)                         # the cancel is lost
            return await answer(code, timeout_s, expressions)

        kernel.execute_internal = deaf  # type: ignore[method-assign]
        kernel.cell()
        await requested.wait()
        async with keeper.lock("ws1"):  # as the runtime's teardown does
            forgetting = asyncio.create_task(keeper.forget(kernel))  # type: ignore[arg-type]
            finished, _ = await asyncio.wait({forgetting}, timeout=5)
            assert forgetting in finished, "the teardown waits for good"
        await asyncio.sleep(0.4)  # the task gets the lock now, and must do nothing
        assert reported == [] and done == []
    asyncio.run(main())


def test_a_restart_is_reported_as_nothing_saved_and_its_manifest_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user cleared the namespace on purpose: the kernel's record becomes
    "nothing" (no key), the checkpoint it replaced is deleted, and the new process's
    cells are checkpointed afresh, even one whose namespace equals the old one's
    (its manifest was just deleted: it must be uploaded again, not named)."""
    async def main() -> None:
        keys: list[str | None] = []
        kernel, _keeper, done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True),
                                    CheckpointRecorded(kept=True, replaced="snap/1"),
                                    CheckpointRecorded(kept=True)], keys)
        kernel.changes = False
        kernel.cell()
        await asyncio.sleep(0.2)
        kernel.restart()
        await asyncio.sleep(0.1)
        assert reported == [1, 0] and keys == ["snap/1", None]
        assert deleted == ["snap/1"]  # ours, replaced by the reset
        assert (done[-1].key, done[-1].cell, done[-1].kept) == (None, 0, True)
        kernel.cell()  # the same namespace as before the restart
        await asyncio.sleep(0.2)
        assert reported == [1, 0, 1] and keys == ["snap/1", None, "snap/2"]
    asyncio.run(main())


def test_the_old_process_s_checkpoint_is_not_reported_after_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Restarted while the old process wrote its snapshot: the flush gives up, and
    only the reset is reported."""
    async def main() -> None:
        keys: list[str | None] = []
        kernel, _keeper, _done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True)], keys)
        kernel.flush_s = 0.3
        kernel.cell()
        await asyncio.sleep(0.1)  # the flush was asked for; the mark is not written
        assert kernel.flushes == 1
        kernel.restart()
        await asyncio.sleep(0.5)
        assert reported == [0] and keys == [None] and deleted == []
    asyncio.run(main())


def test_a_restart_during_the_upload_deletes_it_instead_of_reporting_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        keys: list[str | None] = []
        kernel, _keeper, _done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True)], keys)
        loop = asyncio.get_running_loop()

        def upload(store: object, ws: str, k: object, known: set[str]) -> dict[str, Any]:
            loop.call_soon_threadsafe(kernel.restart)  # the user restarts meanwhile
            time.sleep(0.1)
            return {"key": "snap/old", "bytes": 10, "written": 10}

        monkeypatch.setattr(statesync, "upload", upload)
        kernel.cell()
        await asyncio.sleep(0.4)
        assert reported == [0] and keys == [None]
        assert deleted == ["snap/old"]  # uploaded, never named: its manifest goes
    asyncio.run(main())


def test_a_report_on_its_way_at_the_restart_is_answered_before_the_reset_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It may be recorded whatever the agent does (the request was sent), so the
    reset must come after it, never alongside: it is not cancelled but followed."""
    async def main() -> None:
        keys: list[str | None] = []
        kernel, keeper, done, deleted, reported = _setup(
            tmp_path, monkeypatch, [CheckpointRecorded(kept=True),
                                    CheckpointRecorded(kept=True, replaced="snap/1")], keys)
        answer = keeper.report
        sending = asyncio.Event()
        release = asyncio.Event()
        overlapping: list[int] = []
        busy = 0

        async def slow(ws: str, generation: int, kernel_id: str, saved: dict[str, Any],
                       cell: int) -> CheckpointRecorded:
            nonlocal busy
            busy += 1
            overlapping.append(busy)
            sending.set()
            if cell:
                await release.wait()
            try:
                return await answer(ws, generation, kernel_id, saved, cell)
            finally:
                busy -= 1

        keeper.report = slow
        kernel.cell()
        await sending.wait()
        kernel.restart()
        await asyncio.sleep(0.1)
        assert keys == []  # the reset waits for the report on its way
        release.set()
        await asyncio.sleep(0.1)
        assert keys == ["snap/1", None] and reported == [1, 0]
        assert overlapping == [1, 1]  # one report at a time
        assert deleted == ["snap/1"] and [d.key for d in done] == ["snap/1", None]
    asyncio.run(main())


def test_a_restart_while_the_kernel_is_placed_reports_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its runtime serves it (the placing agent restarts a warm kernel that
    imported what the workspace's layer replaces), a restart clears nothing of the
    user's: the state recorded is the one the placement restores."""
    async def main() -> None:
        kernel, _keeper, _done, _deleted, reported = _setup(
            tmp_path, monkeypatch, [], generation=None)
        kernel.restart()
        await asyncio.sleep(0.1)
        assert reported == []
    asyncio.run(main())


def test_a_forgotten_kernel_s_restart_reports_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        kernel, keeper, _done, _deleted, reported = _setup(tmp_path, monkeypatch, [])
        await keeper.forget(kernel)  # type: ignore[arg-type]
        kernel.restart()
        await asyncio.sleep(0.1)
        assert reported == []
    asyncio.run(main())
