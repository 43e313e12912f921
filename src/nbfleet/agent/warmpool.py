"""The warm pool: started kernels, with the scientific imports done, waiting for a workspace.

Resuming a workspace into a warm kernel skips the interpreter start and the heavy
imports, which are most of a cold start. The pool holds ``target`` plain kernels
(numpy and pandas imported); a claim takes one and a background task starts a
replacement once no resume has been placed for ``refill_delay_s``, so the refill
does not compete for the CPU with the restores of a burst. A claim that finds no
kernel is a miss, and the caller starts a kernel cold.

Prepared kernels: a workspace whose state needs heavier modules (scikit-learn,
SymPy, SciPy) spends seconds importing them on resume. When such a workspace is
suspended here its resume is likely, so the pool also keeps one kernel with that
import set done (:meth:`WarmPool.prepare`), for the ``profiles`` most recent sets.
A claim takes the kernel with the most modules whose set is within the claimant's
own (``preimports``): a kernel never holds a module its workspace did not import.

Cost: one idle kernel (about 100 MB with numpy and pandas imported, a few hundred
with a prepared set) per kernel held; size the target by Little's law from the
host's resume rate and the refill time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.sandbox import Sandbox
from nbfleet.agent.slots import WARM_IMPORTS, Slot, new_kernel

log = logging.getLogger(__name__)

POOL_SIZE = Gauge("nbfleet_agent_warm_pool_size", "Warm kernels ready to be claimed")
POOL_TARGET = Gauge("nbfleet_agent_warm_pool_target", "Warm kernels the pool aims to hold")
POOL_PREPARED = Gauge("nbfleet_agent_warm_pool_prepared",
                      "Ready warm kernels prepared with a suspended workspace's imports")
POOL_PROFILES = Gauge("nbfleet_agent_warm_pool_profiles",
                      "Import sets the pool keeps a prepared kernel for")
CLAIMS = Counter("nbfleet_agent_warm_pool_claims_total", "Claims on the warm pool", ["outcome"])
PREPARED_CLAIMS = Counter("nbfleet_agent_warm_pool_prepared_claims_total",
                          "Claims served by a kernel prepared with the workspace's imports")
HIT_RATIO = Gauge("nbfleet_agent_warm_pool_hit_ratio",
                  "Share of claims the warm pool served since the agent started")

KERNEL_NAME = "python3"


@dataclass
class Warm:
    slot: Slot
    kernel: KernelProcess
    #: Imported beyond WARM_IMPORTS: the import set it was prepared for (empty: plain).
    modules: frozenset[str] = frozenset()


class WarmPool:
    def __init__(self, target: int, new_slot: Callable[[str], Slot], sandbox: Sandbox | None,
                 refill_delay_s: float = 1.0, profiles: int | None = None) -> None:
        """``profiles``: how many import sets to keep a prepared kernel for
        (default: ``target``; 0 prepares none)."""
        self.target = self.configured = target
        self.new_slot = new_slot
        self.sandbox = sandbox
        self.refill_delay_s = refill_delay_s
        self.profiles = target if profiles is None else profiles
        self.ready: list[Warm] = []
        #: Import sets of workspaces suspended here -> resumes expected; oldest first.
        self.demand: OrderedDict[frozenset[str], int] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self._last_claim = float("-inf")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._discards: set[asyncio.Task[None]] = set()
        POOL_TARGET.set(target)
        POOL_SIZE.set_function(lambda: len(self.ready))
        POOL_PREPARED.set_function(lambda: sum(1 for w in self.ready if w.modules))
        POOL_PROFILES.set_function(lambda: len(self.demand))

    def start(self) -> None:
        if self.target > 0 and self._task is None:
            self._task = asyncio.create_task(self._refill_forever())
            self._wake.set()

    def resize(self, wanted: int) -> int:
        """The scheduler's prewarm: hold at least ``wanted`` kernels (never fewer
        than the agent was started with); returns the new target."""
        self.target = max(self.configured, wanted)
        POOL_TARGET.set(self.target)
        self.start()
        self._wake.set()
        return self.target

    def prepare(self, modules: frozenset[str]) -> None:
        """A workspace that imports ``modules`` was suspended here: keep a kernel with
        them imported for its resume (the ``profiles`` most recent sets)."""
        if not modules or self.profiles <= 0:
            return
        self.demand[modules] = self.demand.get(modules, 0) + 1
        self.demand.move_to_end(modules)
        while len(self.demand) > self.profiles:
            dropped, _ = self.demand.popitem(last=False)
            for warm in [w for w in self.ready if w.modules == dropped]:
                self.ready.remove(warm)
                self._discard_later(warm)
        self.start()
        self._wake.set()

    def claim(self, kernel_name: str, needs: frozenset[str] = frozenset()) -> Warm | None:
        """A ready kernel for ``kernel_name`` whose prepared modules are all in
        ``needs`` (the most of them), or None (a miss: start one cold)."""
        warm = self._take(needs) if kernel_name == KERNEL_NAME else None
        if warm is None:
            self.misses += 1
            CLAIMS.labels("miss").inc()
        else:
            self.hits += 1
            CLAIMS.labels("hit").inc()
            if warm.modules:
                PREPARED_CLAIMS.inc()
                left = self.demand.pop(warm.modules, 0) - 1
                if left > 0:
                    self.demand[warm.modules] = left
        HIT_RATIO.set(self.hits / (self.hits + self.misses))
        self._last_claim = time.monotonic()
        self._wake.set()
        return warm

    def _take(self, needs: frozenset[str]) -> Warm | None:
        best: Warm | None = None
        for candidate in list(self.ready):
            if candidate.kernel.execution_state != "idle":  # died while waiting
                self.ready.remove(candidate)
                self._discard_later(candidate)
            elif candidate.modules <= needs and (
                    best is None or len(candidate.modules) > len(best.modules)):
                best = candidate
        if best is not None:
            self.ready.remove(best)
        return best

    def _wanted(self) -> frozenset[str] | None:
        """The next kernel to start (its prepared modules), or None: the pool is full."""
        if sum(1 for w in self.ready if not w.modules) < self.target:
            return frozenset()
        held = {w.modules for w in self.ready}
        return next((m for m in reversed(self.demand) if m not in held), None)

    async def _quiet(self) -> None:
        """Wait ``refill_delay_s`` after the last claim: the claims of a burst come
        together, and a kernel start takes a CPU for about a second.

        It does not wait for resumes being placed: that held the GPU scheduler's
        prewarms back for seconds while it moved kernels (``docs/decisions.md``)."""
        await asyncio.sleep(max(0.0, self._last_claim + self.refill_delay_s - time.monotonic()))

    async def _refill_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._wanted() is not None:
                await self._quiet()
                modules = self._wanted()
                if modules is None:
                    break
                try:
                    warm = await self._start_one(modules)
                except Exception:
                    if modules:  # that import set kills the kernel: its resume goes cold
                        log.exception("could not prepare a kernel with %s", sorted(modules))
                        self.demand.pop(modules, None)
                        continue
                    log.exception("could not start a warm kernel; retrying in 5 s")
                    await asyncio.sleep(5.0)
                    continue
                if modules and modules not in self.demand:  # claimed or dropped meanwhile
                    await self._discard(warm)
                else:
                    self.ready.append(warm)

    async def _start_one(self, modules: frozenset[str] = frozenset()) -> Warm:
        name = f"warm-{secrets.token_hex(4)}"
        slot = await asyncio.to_thread(self.new_slot, name)
        kernel = new_kernel(slot, name, "", KERNEL_NAME, self.sandbox,
                            preimport=(*WARM_IMPORTS, *sorted(modules)))
        try:
            await kernel.start()
        except BaseException:
            await kernel.shutdown()
            await asyncio.to_thread(slot.remove)
            raise
        return Warm(slot, kernel, modules)

    async def discard(self, warm: Warm) -> None:
        """Stop a claimed kernel that will not be used, and remove its slot."""
        await self._discard(warm)

    def _discard_later(self, warm: Warm) -> None:
        task = asyncio.create_task(self._discard(warm))
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    async def _discard(self, warm: Warm) -> None:
        await warm.kernel.shutdown()
        await asyncio.to_thread(warm.slot.remove)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        ready, self.ready = self.ready, []
        await asyncio.gather(*(self._discard(w) for w in ready), return_exceptions=True)
