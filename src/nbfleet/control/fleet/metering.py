"""GPU cells and standby replicas, metered into the credit ledger.

Each GPU cell has its own hold (work id ``cell:{kernel}/{msg_id}``), priced at
the rate of the GPU type its binding actually got, fixed when the cell starts.
Its usage is reported as a cumulative counter while it runs (which renews the
hold's lease) and once more when it ends, then the hold is settled: the ledger
shows one capture per cell. The policy's billing model (seed 004, section 5.5.1)
says what else is billed, through one hold per kernel and generation:

* ``usage`` (batch, lcp): cells only;
* ``replicas`` (notebookos, nbfleet): cells, plus each standby replica's GPUs at
  ``STANDBY_SHARE`` (12.5 %) of the rate;
* ``reserved`` (reservation): the reserved GPUs for the kernel's whole life at
  the full rate, and cells pay nothing more.

Latency: the first cell of a workspace waits for its hold (so an org without
credit never runs one); later cells start at once while their hold is taken in
the background, and a refusal stops the cell and says why. A refusal is
remembered for a few seconds, so the next cells are refused without a
transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from nbfleet.control.fleet.ledger_batch import LedgerBatcher
from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.engine import Database
from nbfleet.db.tables import Workspace
from nbfleet.ledger import audit, holds, metering
from nbfleet.model.errors import DomainError, PaymentRequired
from nbfleet.model.pricing import PriceTable, hold_amount

log = logging.getLogger(__name__)

METER = audit.Actor("system:gpu-cells")
#: A cell's hold covers this much of its GPUs up front; longer cells extend it.
CELL_HOLD_S = 600
#: A hold's lease; every usage report renews it, so only a lost meter lets it lapse.
LEASE_S = 3600
#: How long an org's refusal is remembered before the ledger is asked again.
REFUSAL_MEMORY_S = 5.0
#: What a standby replica pays, as a share of its GPUs' rate (seed 004).
STANDBY_SHARE = 0.125


@dataclass(frozen=True, slots=True)
class Tenant:
    org_id: str
    project_id: str
    user_id: str


@dataclass(slots=True)
class _Meter:
    """One hold being metered: a cell, or a kernel's standby or reserved GPUs."""

    work_id: str
    hold_id: str | None
    gpu_ms: float = 0.0
    seq: int = 0
    since: float = 0.0
    gpus: int = 0  # counted while running (cells), or the standby/reserved GPUs now
    gpu_type: str = ""
    #: Why the ledger refused this meter's hold (a kernel's: asked again until it holds).
    refused: str | None = None


def cell_work_id(task_id: str) -> str:
    work_id = f"cell:{task_id}"
    if len(work_id) <= 100:
        return work_id
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:40]
    return f"cell:{task_id.split('/', 1)[0][:40]}/{digest}"


@dataclass
class CellMeter:
    db: Database
    prices: PriceTable
    billing: str
    clock: Callable[[], float] = time.monotonic
    _tenants: dict[str, Tenant] = field(default_factory=dict)
    _paying: set[str] = field(default_factory=set)
    _refused: dict[str, tuple[str, float]] = field(default_factory=dict)
    _cells: dict[str, _Meter] = field(default_factory=dict)
    _kernels: dict[str, _Meter] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        #: Background reservations and every settle, written in batches.
        self.batch = LedgerBatcher(self.db, METER)

    # --------------------------------------------------------------- cells
    async def admit(self, task_id: str, workspace_id: str, gpu_type: str, gpus: int,
                    on_refused: Callable[[str], None]) -> str | None:
        """Start metering a cell; the reason it may not run, or None.

        ``on_refused`` is called if a hold taken in the background is refused
        after the cell was let through.
        """
        kernel = self._kernels.get(workspace_id)
        if kernel is not None and kernel.refused is not None:
            # The kernel's own GPUs are unpaid: no cell runs until they are (asked
            # again now, at most once per REFUSAL_MEMORY_S).
            refused = self._refused.get(workspace_id)
            if refused is not None and self.clock() < refused[1]:
                return refused[0]
            await self._reserve_kernel(kernel, workspace_id)
            if kernel.refused is not None:
                return kernel.refused
        refused = self._refused.get(workspace_id)
        if refused is not None and self.clock() < refused[1]:
            return refused[0]
        if self.billing == "reserved":
            return None  # the kernel's reservation pays for its cells
        meter = _Meter(cell_work_id(task_id), None, since=self.clock(), gpus=gpus)
        self._cells[task_id] = meter
        if workspace_id in self._paying:
            self._spawn(self._reserve_later(meter, workspace_id, gpu_type, on_refused))
            return None
        reason = await self._reserve(meter, workspace_id, gpu_type)
        if reason is not None:
            self._cells.pop(task_id, None)
        return reason

    def adopt(self, task_id: str, gpus: int, ran_s: float) -> None:
        """A cell that was running when this control plane took over: its hold
        exists already; its usage so far is counted from the agent's report."""
        meter = _Meter(cell_work_id(task_id), None, gpu_ms=ran_s * 1000 * gpus,
                       since=self.clock(), gpus=gpus)
        self._cells[task_id] = meter
        self._spawn(self._find_hold(meter))

    def end(self, task_id: str) -> None:
        """The cell ended: its last usage is captured and its hold settled."""
        meter = self._cells.pop(task_id, None)
        if meter is None:
            return
        self._advance(meter)
        self._spawn(self._settle(meter))

    # ------------------------------------------------------- standby, reserved
    def kernel_gpus(self, workspace_id: str, generation_key: str, gpu_type: str,
                    gpus: int) -> None:
        """How many of a kernel's GPUs are billed by the kernel now (its standby
        replicas', or its reservation's); the meter counts them from here on."""
        if self.billing == "usage":
            return
        meter = self._kernels.get(workspace_id)
        if meter is None:
            if gpus == 0:
                return
            meter = _Meter(f"{self.billing}:{workspace_id}:{generation_key}"[:100], None,
                           since=self.clock(), gpu_type=gpu_type)
            self._kernels[workspace_id] = meter
            self._spawn(self._reserve_kernel(meter, workspace_id))
        elif meter.refused is not None:
            self._spawn(self._reserve_kernel(meter, workspace_id))  # each pass, until paid
        self._advance(meter)
        meter.gpus = gpus

    def kernels_metered(self) -> set[str]:
        return set(self._kernels)

    def kernel_closed(self, workspace_id: str) -> None:
        meter = self._kernels.pop(workspace_id, None)
        if meter is not None:
            self._advance(meter)
            self._spawn(self._settle(meter))

    async def report(self) -> None:
        """Report every open meter's usage (renews the leases, captures as it goes)."""
        reports = []
        for meter in [*self._cells.values(), *self._kernels.values()]:
            self._advance(meter)
            if meter.hold_id is not None and int(meter.gpu_ms):
                meter.seq += 1
                reports.append(metering.UsageReport(meter.hold_id, meter.seq, int(meter.gpu_ms)))
        if reports:
            await asyncio.to_thread(self._apply, reports)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.batch.aclose()

    # ---------------------------------------------------------------- ledger
    def _advance(self, meter: _Meter) -> None:
        now = self.clock()
        meter.gpu_ms += (now - meter.since) * 1000 * meter.gpus
        meter.since = now

    def _rate(self, gpu_type: str) -> int:
        rate = self.prices.rate(gpu_type)
        if self.billing == "replicas":
            return math.ceil(rate * STANDBY_SHARE)
        return rate

    async def _reserve(self, meter: _Meter, workspace_id: str, gpu_type: str,
                       batched: bool = False) -> str | None:
        tenant = await self._tenant(workspace_id)
        if tenant is None:
            return "the workspace is gone"
        rate = self.prices.rate(gpu_type)
        request = holds.HoldRequest(meter.work_id, tenant.org_id, tenant.project_id,
                                    tenant.user_id, gpu_type, rate,
                                    hold_amount(CELL_HOLD_S, max(1, meter.gpus), rate), LEASE_S)
        try:
            meter.hold_id = (await self.batch.reserve(request) if batched
                             else await asyncio.to_thread(self._hold, request))
        except PaymentRequired as refused:
            reason = f"no credit for this cell: {refused.detail}"
            self._refused[workspace_id] = (reason, self.clock() + REFUSAL_MEMORY_S)
            self._paying.discard(workspace_id)
            return reason
        self._paying.add(workspace_id)
        self._refused.pop(workspace_id, None)
        return None

    async def _reserve_later(self, meter: _Meter, workspace_id: str, gpu_type: str,
                             on_refused: Callable[[str], None]) -> None:
        reason = await self._reserve(meter, workspace_id, gpu_type, batched=True)
        if reason is not None:
            on_refused(reason)

    async def _reserve_kernel(self, meter: _Meter, workspace_id: str) -> None:
        """Hold credit for the kernel's own GPUs; until the ledger agrees the
        meter stays refused, its usage uncounted, and the kernel's cells wait."""
        tenant = await self._tenant(workspace_id)
        if tenant is None:
            return
        rate = self._rate(meter.gpu_type)
        request = holds.HoldRequest(meter.work_id, tenant.org_id, tenant.project_id,
                                    tenant.user_id, meter.gpu_type, rate,
                                    hold_amount(CELL_HOLD_S, max(1, meter.gpus), rate), LEASE_S)
        try:
            meter.hold_id = await asyncio.to_thread(self._hold, request)
        except PaymentRequired as refused:
            reason = f"no credit for the kernel's {self.billing} GPUs: {refused.detail}"
            meter.refused = reason
            meter.gpu_ms = 0.0  # nothing held: nothing to report until it is
            self._refused[workspace_id] = (reason, self.clock() + REFUSAL_MEMORY_S)
            return
        meter.refused = None
        self._refused.pop(workspace_id, None)

    def _hold(self, request: holds.HoldRequest) -> str:
        with self.db.transaction() as session:
            hold, _created = holds.reserve(session, request, METER, self.db.now(session))
            return hold.id

    async def _find_hold(self, meter: _Meter) -> None:
        def find() -> str | None:
            with self.db.transaction(write=False) as session:
                return session.execute(select(CreditHold.id).where(
                    CreditHold.work_id == meter.work_id)).scalar_one_or_none()
        meter.hold_id = await asyncio.to_thread(find)

    async def _settle(self, meter: _Meter) -> None:
        for _ in range(50):  # a hold still being reserved in the background
            if meter.hold_id is not None:
                break
            await asyncio.sleep(0.1)
        if meter.hold_id is None:
            return
        self.batch.settle(meter.hold_id, int(meter.gpu_ms), meter.seq + 1, meter.work_id)

    def _apply(self, reports: list[metering.UsageReport]) -> None:
        """One transaction for the reports that fit their holds; one each for those
        that need an extension (which may be refused: the usage is then recorded
        as uncovered, and the hold says it is exhausted)."""
        with self.db.transaction() as session:
            outcomes = metering.report_batch(session, reports, METER, self.db.now(session))
        for outcome, report in zip(outcomes, reports, strict=True):
            if outcome.status != metering.NEEDS_EXTENSION:
                continue
            try:
                with self.db.transaction() as session:
                    metering.report_with_extension(session, report, METER,
                                                   self.db.now(session))
            except DomainError as exc:
                log.warning("usage of hold %s not captured: %s", report.hold_id, exc.detail)

    async def _tenant(self, workspace_id: str) -> Tenant | None:
        tenant = self._tenants.get(workspace_id)
        if tenant is not None:
            return tenant

        def read() -> Tenant | None:
            with self.db.transaction(write=False) as session:
                ws = session.get(Workspace, workspace_id)
                return None if ws is None else Tenant(ws.org_id, ws.project_id, ws.owner_id)
        tenant = await asyncio.to_thread(read)
        if tenant is not None:
            self._tenants[workspace_id] = tenant
        return tenant

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
