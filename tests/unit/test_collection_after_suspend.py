"""The reconciler's collection after a suspend (``control/collection.py``): the new
snapshot is recorded before anything is deleted, and nothing is deleted once the
step is no longer this replica's, nor after the step was cancelled."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nbfleet.control import collection
from nbfleet.control.step_results import Work
from nbfleet.db.engine import Database
from nbfleet.db.tables import Workspace
from nbfleet.model.workspace import DesiredState, WorkspaceState, plan
from nbfleet.protocol.agent import RuntimeSuspended, SavedKernel, SavedSnapshot
from nbfleet.storage import collect as collect_module
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.snapshots import download_state, upload_state
from tests.support.rows import add_workspace
from tests.unit.test_snapshots_store import write_state

WS, KERNEL, GENERATION = "ws_collect", "k1", 5
#: Values the previous snapshot held and the new one does not.
REPLACED = 12


def _always(session: Any) -> bool:
    return True


class Setup:
    def __init__(self, db: Database, tmp_path: Path) -> None:
        self.db, self.root = db, tmp_path / "store"
        self.store = BlobStore(str(self.root))
        kept = os.urandom(500)
        old = {f"old{n}": os.urandom(500) for n in range(REPLACED)}
        write_state(tmp_path / "old", {"kept": kept, **old})
        write_state(tmp_path / "new", {"kept": kept, "fresh": os.urandom(500)})
        self.old = upload_state(self.store, WS, KERNEL, str(tmp_path / "old")).key
        new = upload_state(self.store, WS, KERNEL, str(tmp_path / "new"))
        self.new = new.key
        self.previous = {"kernels": {KERNEL: {"key": self.old, "cell": 3}}, "packages": None}
        add_workspace(db, WS, KERNEL, "c", state=WorkspaceState.SUSPENDING,
                      desired_state=DesiredState.SUSPENDED, generation=GENERATION,
                      snapshot=self.previous)
        step = plan(WorkspaceState.RUNNING, DesiredState.SUSPENDED)
        assert step is not None
        self.work = Work(WS, step, GENERATION, WorkspaceState.SUSPENDING, "http://agent",
                         ((KERNEL, "python3"),), self.previous)
        self.result = RuntimeSuspended(released=True, snapshot=SavedSnapshot(
            kernels={KERNEL: SavedKernel(key=self.new, bytes=new.bytes_total,
                                         written=new.bytes_written)},
            packages=None, bytes=new.bytes_total))

    def blobs(self) -> int:
        return sum(1 for p in (self.root / "workspaces" / WS / "cas").rglob("*") if p.is_file())

    def recorded_key(self) -> str | None:
        with self.db.transaction(write=False) as session:
            ws = session.get(Workspace, WS)
            assert ws is not None
            return (ws.snapshot or {}).get("kernels", {}).get(KERNEL, {}).get("key")

    async def run(self, holds_lease: Any = _always) -> None:
        await collection.after_suspend(self.db, self.store, self.work, self.result, holds_lease)


@pytest.fixture
def setup(db: Database, tmp_path: Path) -> Setup:
    return Setup(db, tmp_path)


async def test_the_new_snapshot_is_recorded_then_the_old_data_goes(setup: Setup) -> None:
    assert setup.blobs() == REPLACED + 2
    await setup.run()
    assert setup.recorded_key() == setup.new
    assert setup.blobs() == 2  # kept and fresh
    assert not (setup.root / setup.old).exists()
    download_state(setup.store, WS, setup.new, str(setup.root.parent / "back"))


async def test_a_failing_collection_still_leaves_the_new_snapshot_recorded(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the step cut short after the agent released the runtime, a retry would
    record nothing: the record comes first."""
    def broken(*args: Any) -> None:
        raise OSError("the store is down")

    monkeypatch.setattr(collection, "collect", broken)
    await setup.run()
    assert setup.recorded_key() == setup.new


async def test_nothing_is_recorded_or_deleted_once_the_step_is_not_ours(setup: Setup) -> None:
    await setup.run(holds_lease=lambda session: False)
    assert (setup.recorded_key(), setup.blobs()) == (setup.old, REPLACED + 2)
    with setup.db.transaction() as session:  # a resume was asked for meanwhile
        ws = session.get(Workspace, WS)
        assert ws is not None
        ws.generation = GENERATION + 1
    await setup.run()
    assert (setup.recorded_key(), setup.blobs()) == (setup.old, REPLACED + 2)


async def test_a_lease_lost_midway_stops_the_deletes(setup: Setup,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collect_module, "BATCH", 2)
    checks = iter([True, True, True])  # the record, then two batches

    await setup.run(holds_lease=lambda session: next(checks, False))
    assert setup.recorded_key() == setup.new
    assert setup.blobs() == REPLACED + 2 - 3  # the old manifest, then 3 of its blobs


async def test_a_cancelled_step_deletes_nothing_after_it_ends(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling a task does not stop the thread it awaits: the collection must stop
    itself before the step ends and the lease may pass to another replica."""
    monkeypatch.setattr(collect_module, "BATCH", 1)
    started = threading.Event()
    delete_many = setup.store.delete_many

    def slow(keys: list[str]) -> None:
        started.set()
        time.sleep(0.05)
        delete_many(keys)

    monkeypatch.setattr(setup.store, "delete_many", slow)
    task = asyncio.ensure_future(setup.run())
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    left = setup.blobs()
    await asyncio.sleep(0.3)  # six more batches' time
    assert setup.blobs() == left > 2
