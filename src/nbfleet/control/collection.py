"""After a suspend: keep the new snapshot, then delete what no snapshot names.

The reconciler's suspend step calls :func:`after_suspend` between the agent's
answer and the step's end, while the workspace is still ``suspending``: no runtime
of it exists then, and none can start (``storage/collect.py`` says why that is
the condition). Two orders matter, both found by a review of the first version:

- The new snapshot is recorded first. Were the step cut short after the agent
  released the runtime (a shutdown, a lost lease), a retry finds no runtime and
  records nothing: the suspend's state would be lost, then collected.
- Before each batch of deletes, the collection checks that this replica still
  holds the lease and the workspace is still suspending at this generation. A
  cancelled step stops its worker thread at the next batch before it ends (a
  thread is not stopped by cancelling the task that awaits it), so the lease is
  never handed over while this replica still deletes.

A resume asked for during the suspend bumps the generation: nothing is collected,
and the resume does not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from prometheus_client import Counter
from sqlalchemy.orm import Session

from nbfleet.control.step_results import Work, record
from nbfleet.db.engine import Database
from nbfleet.db.tables import Workspace
from nbfleet.protocol.agent import RuntimeSuspended
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.collect import collect, snapshot_keys

log = logging.getLogger(__name__)

COLLECTIONS = Counter("nbfleet_snapshot_collections_total",
                      "Collections of superseded snapshot data after a suspend", ["outcome"])
COLLECTED_BYTES = Counter("nbfleet_snapshot_collected_bytes_total",
                          "Bytes of superseded kernel snapshots deleted from the blob store")

#: ``session -> whether this replica holds the reconciler's lease``.
LeaseCheck = Callable[[Session], bool]


def _ours(session: Session, work: Work, holds_lease: LeaseCheck, lock: bool) -> Workspace | None:
    """The workspace, if this replica may still act on this step of it."""
    if not holds_lease(session):
        return None
    ws = session.get(Workspace, work.workspace_id, with_for_update=lock)
    if ws is None or ws.state != work.expect_state or ws.generation != work.generation:
        return None
    return ws


def keep_saved(db: Database, work: Work, result: RuntimeSuspended,
               holds_lease: LeaseCheck) -> set[str] | None:
    """Record the suspend's snapshot now (the step's end records it again, the same);
    the store keys the record names, or None when the step is no longer ours."""
    with db.transaction() as session:
        ws = _ours(session, work, holds_lease, lock=True)
        if ws is None:
            return None
        record(ws, work, result, db.now(session))
        return snapshot_keys(ws.snapshot)


async def after_suspend(db: Database, store: BlobStore, work: Work, result: RuntimeSuspended,
                        holds_lease: LeaseCheck) -> None:
    """Record the new snapshot, then collect; a failure is logged and the suspend
    stands (the next one collects)."""
    if result.snapshot is None:
        return
    try:
        keep = await asyncio.to_thread(keep_saved, db, work, result, holds_lease)
    except Exception as exc:  # the step's end records it, or says why it cannot
        COLLECTIONS.labels("failed").inc()
        log.warning("recording the snapshot of %s before collecting failed: %s",
                    work.workspace_id, exc)
        return
    if keep is None:
        COLLECTIONS.labels("skipped").inc()
        return
    stop = threading.Event()

    def proceed() -> bool:
        if stop.is_set():
            return False
        with db.transaction(write=False) as session:
            return _ours(session, work, holds_lease, lock=False) is not None

    task = asyncio.ensure_future(asyncio.to_thread(collect, store, work.workspace_id, keep,
                                                   proceed))
    try:
        done = await asyncio.shield(task)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait({task})
        raise
    except Exception as exc:
        COLLECTIONS.labels("failed").inc()
        log.warning("collecting the old snapshot data of %s failed: %s", work.workspace_id, exc)
        return
    COLLECTIONS.labels("stopped" if done.stopped else "done").inc()
    COLLECTED_BYTES.inc(done.bytes)
    if done.manifests or done.blobs:
        log.info("%s: deleted %d old manifests and %d blobs (%d bytes)%s", work.workspace_id,
                 done.manifests, done.blobs, done.bytes, ", then stopped" if done.stopped else "")
