"""Tracks which user names each cell changed and pickles them in the background.

The main thread only diffs the namespace, scans the cell and grabs references
(well under a millisecond); pickling, checking, hashing and writing blobs happen
on one worker thread while the user reads the output (see
:mod:`nbfleet.kernel.cycle` for what a pass does and costs). Pickling an object
while the next cell mutates it would give a torn value, so every cell start
bumps an epoch and the worker drops whatever it pickled across an epoch change.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbfleet.kernel import cellscan, settings
from nbfleet.kernel.blobs import BlobStore, ChangedWhileStoring
from nbfleet.kernel.cycle import OUT, Cycle, Failed, Record, Saved
from nbfleet.kernel.recipes import CellRecord, RecipeBook, can_change_in_place
from nbfleet.kernel.tokens import ShaCache

__all__ = ["ABANDONED", "OUT", "Capture", "Failed", "Record", "Saved"]

log = logging.getLogger("nbfleet.kernel")

#: Why a checkpoint was given up when a cell started first (not a failure).
ABANDONED = "a cell started"


@dataclass(frozen=True)
class _Job:
    epoch: int
    mark: int
    roots: dict[str, object]  # every root's value at cell end


@dataclass(frozen=True)
class _Checkpoint:
    """A snapshot the agent asked for between cells, written by the worker
    (``snapshot.checkpoint``); abandoned if a cell starts before it is done."""

    epoch: int
    seq: int


class Capture:
    """Per-kernel capture state; one instance lives while the extension is loaded."""

    def __init__(self, shell: Any, state_dir: Path) -> None:
        self.shell = shell
        self.state_dir = state_dir
        self.store = BlobStore(state_dir / "blobs")
        self.imports: list[str] = []
        self.footprints: dict[str, frozenset[str]] = {}
        self.definitions: dict[str, str] = {}  # name -> source of its def / lambda
        # Values a restore could not bring back, reported again by every snapshot until
        # the name is bound anew: a later resume must not pass over them in silence.
        self.still_lost: dict[str, dict[str, str]] = {}
        self.recipes = RecipeBook()
        self.records: dict[str, Record] = {}
        # Outputs left out of Out because they cannot be pickled, by "Out[n]".
        self.dropped_outputs: dict[str, dict[str, str]] = {}
        self.calls = settings.CallLog()
        self.baseline: settings.Baseline | None = None
        #: What the last restore or standby apply loaded (``delta.Applied``); None
        #: once a cell has run, as a later apply must start from a loaded snapshot.
        self.applied: Any = None
        self.last_post_run_seconds = 0.0
        self._cache = ShaCache()
        self._lock = threading.Lock()
        self._epoch = 0
        self._mark = 0
        self._dirty: dict[str, int] = {}  # name -> mark of the cell that dirtied it
        self._outputs: tuple[int, Any] = (0, None)  # Out's size and last key when last seen
        self._before: list[dict[str, int]] = []  # a stack: cells can run cells
        self._queue: queue.Queue[_Job | _Checkpoint | None] = queue.Queue()
        #: Writes a checkpoint on the worker (set by the extension: ``snapshot``
        #: imports this module); called with (seq, epoch), and with ok=False when
        #: the checkpoint is dropped unwritten.
        self.checkpoint_writer: Callable[[int, int], None] | None = None
        self.checkpoint_dropped: Callable[[int, str], None] | None = None
        self._worker = threading.Thread(target=self._work, name="nbfleet-capture", daemon=True)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self.baseline = settings.Baseline.take(self.shell)
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self._worker.start()
        self._dirty_and_submit(set(self.user_ids()))  # whatever was there before us

    def stop(self) -> None:
        for event, callback in (("pre_run_cell", self.pre_run_cell),
                                ("post_run_cell", self.post_run_cell)):
            with contextlib.suppress(ValueError):
                self.shell.events.unregister(event, callback)
        self._queue.put(None)
        self._worker.join(timeout=30)

    def idle(self) -> None:
        """Wait until the worker has dealt with every cell so far (a pause, in tests)."""
        self._queue.join()

    def quiesce(self) -> None:
        """Let the worker finish, and void anything it was about to commit."""
        self._queue.join()
        with self._lock:
            self._epoch += 1

    # -- the namespace -------------------------------------------------------

    def user_ids(self) -> dict[str, int]:
        """``{name: id(value)}`` of user names: no ``_x``, no IPython-provided values."""
        return {name: id(value) for name, value in self._user_values().items()}

    def _user_values(self) -> dict[str, object]:
        hidden = self.shell.user_ns_hidden
        missing = object()
        return {
            name: value
            for name, value in self.shell.user_ns.items()
            if isinstance(name, str) and not name.startswith("_")
            and hidden.get(name, missing) is not value
        }

    def _output_history(self) -> dict[Any, object] | None:
        history = getattr(self.shell, "history_manager", None)
        outputs = getattr(history, "output_hist", None)
        return outputs if isinstance(outputs, dict) else None

    def roots(self) -> dict[str, object]:
        """What a snapshot saves: the user names, and ``Out`` as a pseudo-name."""
        roots = self._user_values()
        outputs = self._output_history()
        if outputs:
            roots[OUT] = dict(outputs)
        return roots

    # -- IPython hooks (main thread) -----------------------------------------

    def pre_run_cell(self, info: Any = None) -> None:
        self.applied = None
        with self._lock:
            self._epoch += 1
        self._before.append(self.user_ids())

    def post_run_cell(self, result: Any) -> None:
        started = time.perf_counter()
        try:
            self._after_cell(result)
        except Exception:  # capture must never break the user's kernel
            log.exception("nbfleet: tracking the cell's changes failed")
        self.last_post_run_seconds = time.perf_counter() - started

    def _after_cell(self, result: Any) -> None:
        info = result.info
        source = getattr(info, "transformed_cell", None)
        if source is None:
            source = self.shell.transform_cell(info.raw_cell or "")
        after = self.user_ids()
        before = self._before.pop() if self._before else {}
        scan = cellscan.scan(source, self.footprints)
        ns = self.shell.user_ns

        changed = {name for name, ident in after.items() if before.get(name) != ident}
        defined = changed | (scan.defined & after.keys())
        deleted = (before.keys() - after.keys()) | ((scan.deleted | scan.defined) - after.keys())
        # ``for x in it:`` advances an iterator the cell never calls a method of
        consumed = {name for name in scan.iterated & after.keys()
                    if hasattr(type(ns[name]), "__next__")}
        touched = (scan.mutated & after.keys()) | consumed
        if touched:  # ``b = a`` earlier: mutating b changed a too
            ids = {after[name] for name in touched}
            touched |= {name for name, ident in after.items() if ident in ids}
        mutated = touched - defined
        success = bool(result.success)

        self._track_imports(scan, success, after)
        if success:
            self.calls.record(scan.settings)
        for name, footprint in scan.functions.items():
            self.footprints[name] = footprint
        for name in (defined - scan.functions.keys()) | deleted:
            self.footprints.pop(name, None)
        for name in (defined - scan.definitions.keys()) | deleted:
            self.definitions.pop(name, None)
        self.definitions.update((name, source) for name, source in scan.definitions.items()
                                if name in after)
        if defined or mutated:
            cell = CellRecord(
                source, success, scan.uses_magic,
                frozenset(n for n in touched if can_change_in_place(ns[n])),
                scan.loaded | scan.mutated,
            )
            rebuilt = defined & scan.loaded & before.keys()  # ``x = x + 1``
            self.recipes.record(cell, defined - rebuilt, rebuilt, mutated)
        for name in deleted:
            self.recipes.forget(name)
        for name in defined | deleted:
            self.still_lost.pop(name, None)
        with self._lock:
            for name in deleted:
                self._dirty.pop(name, None)
                self.records.pop(name, None)
        self._dirty_and_submit(defined | mutated | self._outputs_changed())

    def _outputs_changed(self) -> set[str]:
        outputs = self._output_history() or {}
        seen = (len(outputs), next(reversed(outputs)) if outputs else None)
        if seen == self._outputs:
            return set()
        self._outputs = seen
        return {OUT}

    def _track_imports(self, scan: cellscan.CellScan, success: bool, after: dict[str, int]) -> None:
        for statement in scan.imports:
            if statement in self.imports:
                continue
            if not success:  # keep it only if it evidently ran
                bound = cellscan.import_bindings(statement)
                if not bound or not all(name in after for name in bound):
                    continue
            self.imports.append(statement)

    def _dirty_and_submit(self, names: set[str]) -> None:
        roots = self.roots()
        with self._lock:
            self._mark += 1
            for name in names:
                self._dirty[name] = self._mark
            job = _Job(self._epoch, self._mark, roots)
        self._queue.put(job)

    # -- the worker ----------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                while job is not None:  # only the latest cell's view matters
                    try:
                        newer = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    self._queue.task_done()
                    if isinstance(job, _Checkpoint):
                        self._dropped(job.seq, ABANDONED)
                    job = newer
                if job is None:
                    return
                if isinstance(job, _Checkpoint):
                    self._checkpoint(job)
                else:
                    self._run(job)
            except Exception:
                log.exception("nbfleet: background capture failed")
            finally:
                del job
                self._queue.task_done()

    def _valid(self, epoch: int) -> bool:
        with self._lock:
            return self._epoch == epoch

    valid = _valid

    def commit_if_valid(self, epoch: int, commit: Callable[[], None]) -> bool:
        """Run ``commit`` unless a cell started since ``epoch`` (none can start
        while it runs: a cell's start takes the same lock)."""
        with self._lock:
            if self._epoch != epoch:
                return False
            commit()
            return True

    # -- checkpoints (the agent's, after a cell; written off the main thread) ----

    def request_checkpoint(self, seq: int) -> None:
        """Main thread, between cells: have the worker snapshot the namespace as it
        is now, without holding up the next cell (it abandons the snapshot)."""
        with self._lock:
            epoch = self._epoch
        self._queue.put(_Checkpoint(epoch, seq))

    def _checkpoint(self, job: _Checkpoint) -> None:
        if self.checkpoint_writer is None:
            self._dropped(job.seq, "no checkpoint writer")
        elif not self._valid(job.epoch):
            self._dropped(job.seq, ABANDONED)
        else:
            self.checkpoint_writer(job.seq, job.epoch)

    def _dropped(self, seq: int, reason: str) -> None:
        if self.checkpoint_dropped is not None:
            self.checkpoint_dropped(seq, reason)

    def _run(self, job: _Job) -> None:
        with self._lock:
            if self._epoch != job.epoch:
                return  # a cell is running: its end will submit again
            dirty = set(self._dirty)
            records = dict(self.records)
        cycle = Cycle(records, job.roots, dirty, self.shell.user_ns, self.store, self._cache,
                      lambda: self._valid(job.epoch))
        try:
            result = cycle.run()
        except ChangedWhileStoring:
            return  # mutated under us: only possible if a cell is running
        if result is None:
            return
        with self._lock:
            if self._epoch != job.epoch:
                return  # the values may have changed while we pickled them
            self._commit(result, job.mark, cycle.dropped_outputs)

    def _commit(self, result: dict[str, Record], mark: int,
                dropped: dict[str, dict[str, str]]) -> None:
        """Under the lock: adopt a cycle's records; names dirtied since stay dirty."""
        for name, record in result.items():
            self.records[name] = record
            if self._dirty.get(name, mark + 1) <= mark:
                del self._dirty[name]
        if OUT in result:
            self.dropped_outputs = dropped

    # -- flush support (main thread, no cell running) ---------------------------

    def settle(self, epoch: int | None = None) -> dict[str, Record] | None:
        """Check every group exactly; returns every record. On the main thread
        (``epoch`` None) it waits for the worker first; on the worker (a checkpoint
        taken in ``epoch``) it returns None as soon as a cell starts."""
        valid = None if epoch is None else (lambda: self._valid(epoch))
        if epoch is None:
            self._queue.join()
        for attempt in (1, 2):
            roots = self.roots()
            with self._lock:
                for name in [n for n in self.records if n not in roots]:
                    del self.records[name]
                dirty = set(self._dirty)
                records = dict(self.records)
                mark = self._mark
            cycle = Cycle(records, roots, dirty, self.shell.user_ns, self.store, None,
                          valid or (lambda: True))
            try:
                result = cycle.run()
            except ChangedWhileStoring:  # a user thread is writing to it: try once more
                if valid is not None and not valid():
                    return None
                if attempt == 2:
                    raise
                continue
            with self._lock:
                if epoch is not None and self._epoch != epoch:
                    return None  # a cell started: what was pickled may be torn
                self._commit(result or {}, mark, cycle.dropped_outputs)
            break
        return dict(self.records)

    def forget_names(self, names: set[str]) -> None:
        """Names a standby apply removed (deleted on the executor since)."""
        with self._lock:
            for name in names:
                self.records.pop(name, None)
                self._dirty.pop(name, None)

    def adopt(self, records: dict[str, Record], imports: list[str],
              footprints: dict[str, frozenset[str]], recipes: dict[str, list[str]],
              definitions: dict[str, str] | None = None,
              lost: dict[str, dict[str, str]] | None = None,
              changed: set[str] | None = None) -> None:
        """After a restore: the restored values are clean and keep their blobs, except
        ``changed`` ones (restored, but not equal to what was saved): saved again."""
        with self._lock:
            for name, record in records.items():
                self.records[name] = record
                self._dirty.pop(name, None)
            self._mark += 1
            for name in changed or ():
                self._dirty[name] = self._mark
        for statement in imports:
            if statement not in self.imports:
                self.imports.append(statement)
        self.footprints.update(footprints)
        self.definitions.update(definitions or {})
        self.still_lost.update(lost or {})
        for name, sources in recipes.items():
            self.recipes.seed(name, sources, self.footprints)
        outputs = self._output_history() or {}
        self._outputs = (len(outputs), next(reversed(outputs)) if outputs else None)
