"""Cell holds reserved and settled in batches: one transaction for all that arrive
together, instead of two per cell.

A notebook can run a cell every few milliseconds, and each cell is its own hold
(its entry in the ledger). A transaction costs more than the binding itself
(about 3-8 ms, ``docs/benchmarks.md``), and the cells after a workspace's first
do not wait for theirs: so those reservations, and every settle, are queued and
written together, within ``WINDOW_S`` of the first one queued. Each still gets
its own hold, capture and settle, exactly as one at a time would
(``holds.reserve_many`` keeps their order).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nbfleet.db.engine import Database
from nbfleet.ledger import audit, holds, metering
from nbfleet.model.errors import DomainError

log = logging.getLogger(__name__)

#: How long the first queued item waits for others to share its transaction.
WINDOW_S = 0.1
#: At most this many in one transaction.
MAX_BATCH = 256


@dataclass(frozen=True, slots=True)
class _Settle:
    hold_id: str
    gpu_ms: int
    seq: int
    work_id: str


class LedgerBatcher:
    def __init__(self, db: Database, actor: audit.Actor) -> None:
        self.db, self.actor = db, actor
        self._reserves: list[tuple[holds.HoldRequest, asyncio.Future[str]]] = []
        self._settles: list[_Settle] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def reserve(self, request: holds.HoldRequest) -> str:
        """The hold's id; raises the ledger's refusal (``PaymentRequired``...)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._reserves.append((request, future))
        self._kick()
        return await future

    def settle(self, hold_id: str, gpu_ms: int, seq: int, work_id: str) -> None:
        """Report the final usage and settle the hold (``finished``), soon."""
        self._settles.append(_Settle(hold_id, gpu_ms, seq, work_id))
        self._kick()

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush_forever())
        self._wake.set()

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(WINDOW_S)
            self._wake.clear()
            reserves, self._reserves = self._reserves[:MAX_BATCH], self._reserves[MAX_BATCH:]
            settles, self._settles = self._settles[:MAX_BATCH], self._settles[MAX_BATCH:]
            if self._reserves or self._settles:
                self._wake.set()
            if reserves:
                await self._flush_reserves(reserves)
            if settles:
                await asyncio.to_thread(self._write_settles, settles)

    async def _flush_reserves(self, batch: list[tuple[holds.HoldRequest,
                                                       asyncio.Future[str]]]) -> None:
        def write() -> list[holds.Reserved | DomainError]:
            with self.db.transaction() as session:
                return holds.reserve_many(session, [(r, self.actor) for r, _ in batch],
                                          self.db.now(session))
        try:
            outcomes = await asyncio.to_thread(write)
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue
            if isinstance(outcome, DomainError):
                future.set_exception(outcome)
            else:
                future.set_result(outcome[0].id)

    def _write_settles(self, batch: list[_Settle]) -> None:
        """One transaction for the final reports that fit their holds and every
        settle; one each for those that need an extension (as ``report`` does)."""
        finals = [metering.UsageReport(s.hold_id, s.seq, s.gpu_ms) for s in batch if s.gpu_ms]
        extend: set[str] = set()
        try:
            with self.db.transaction() as session:
                now = self.db.now(session)
                if finals:
                    outcomes = metering.report_batch(session, finals, self.actor, now,
                                                     lock_buckets=True)
                    extend = {r.hold_id for r, o in zip(finals, outcomes, strict=True)
                              if o.status == metering.NEEDS_EXTENSION}
                for item in batch:
                    if item.hold_id not in extend:
                        holds.settle(session, item.hold_id, "finished", self.actor, now)
        except DomainError as exc:
            log.warning("settling %d cell holds failed: %s; each on its own now",
                        len(batch), exc.detail)
            extend = {item.hold_id for item in batch}
        for item in batch:
            if item.hold_id in extend:
                self._settle_one(item)

    def _settle_one(self, item: _Settle) -> None:
        try:
            with self.db.transaction() as session:
                now = self.db.now(session)
                if item.gpu_ms:
                    final = metering.UsageReport(item.hold_id, item.seq, item.gpu_ms)
                    (result,) = metering.report_batch(session, [final], self.actor, now,
                                                      lock_buckets=True)
                    if result.status == metering.NEEDS_EXTENSION:
                        metering.report_with_extension(session, final, self.actor, now)
                holds.settle(session, item.hold_id, "finished", self.actor, now)
        except DomainError as exc:
            log.warning("settling %s failed: %s", item.work_id, exc.detail)

    async def aclose(self) -> None:
        """Write what is queued, then stop."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        reserves, self._reserves = self._reserves, []
        for _, future in reserves:
            future.cancel()
        settles, self._settles = self._settles, []
        if settles:
            await asyncio.to_thread(self._write_settles, settles)
