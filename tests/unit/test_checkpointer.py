"""The agent's cell checkpoints: coalesced, never ahead of a queued cell, and the
manifest of a checkpoint the control plane replaced (or refused) deleted."""

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
        count = self.count

        async def write() -> None:
            await asyncio.sleep(self.flush_s)
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


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           answers: list[CheckpointRecorded]) -> tuple[FakeKernel, Checkpointer,
                                                          list[Done], list[str], list[int]]:
    kernel = FakeKernel(tmp_path)
    uploads = iter(range(1, 100))
    monkeypatch.setattr(statesync, "upload", lambda store, ws, k, known: {
        "key": f"snap/{next(uploads)}", "bytes": 10, "written": 10})
    deleted: list[str] = []
    reported: list[int] = []

    async def report(ws: str, generation: int, kernel_id: str, saved: dict[str, Any],
                     cell: int) -> CheckpointRecorded:
        reported.append(cell)
        return answers.pop(0)

    store = SimpleNamespace(delete=deleted.append)
    locks: dict[str, asyncio.Lock] = {}
    keeper = Checkpointer(store, lambda ws: locks.setdefault(ws, asyncio.Lock()),  # type: ignore[arg-type]
                          lambda k: 3, report)
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
