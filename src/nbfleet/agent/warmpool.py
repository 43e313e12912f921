"""The warm pool: started kernels, with the scientific imports done, waiting for a workspace.

Resuming a workspace into a warm kernel skips the interpreter start and the heavy
imports, which are most of a cold start. The pool holds ``target`` kernels; a claim
takes one and a background task starts a replacement a moment later, so the refill
does not compete for the CPU with the restore that just claimed a kernel. A claim
that finds the pool empty is a miss, and the caller starts a kernel cold.

Cost: one idle kernel (about 100 MB with numpy and pandas imported) per slot; size
the target by Little's law from the host's resume rate and the refill time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.sandbox import Sandbox
from nbfleet.agent.slots import WARM_IMPORTS, Slot, new_kernel

log = logging.getLogger(__name__)

POOL_SIZE = Gauge("nbfleet_agent_warm_pool_size", "Warm kernels ready to be claimed")
POOL_TARGET = Gauge("nbfleet_agent_warm_pool_target", "Warm kernels the pool aims to hold")
CLAIMS = Counter("nbfleet_agent_warm_pool_claims_total", "Claims on the warm pool", ["outcome"])
HIT_RATIO = Gauge("nbfleet_agent_warm_pool_hit_ratio",
                  "Share of claims the warm pool served since the agent started")

KERNEL_NAME = "python3"


@dataclass
class Warm:
    slot: Slot
    kernel: KernelProcess


class WarmPool:
    def __init__(self, target: int, new_slot: Callable[[str], Slot], sandbox: Sandbox | None,
                 refill_delay_s: float = 1.0) -> None:
        self.target = self.configured = target
        self.new_slot = new_slot
        self.sandbox = sandbox
        self.refill_delay_s = refill_delay_s
        self.ready: list[Warm] = []
        self.hits = 0
        self.misses = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._discards: set[asyncio.Task[None]] = set()
        POOL_TARGET.set(target)
        POOL_SIZE.set_function(lambda: len(self.ready))

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

    def claim(self, kernel_name: str) -> Warm | None:
        """A ready kernel for ``kernel_name``, or None (a miss: start one cold)."""
        warm = None
        while kernel_name == KERNEL_NAME and self.ready:
            candidate = self.ready.pop(0)
            if candidate.kernel.execution_state == "idle":
                warm = candidate
                break
            task = asyncio.create_task(self._discard(candidate))  # died while waiting
            self._discards.add(task)
            task.add_done_callback(self._discards.discard)
        if warm is None:
            self.misses += 1
            CLAIMS.labels("miss").inc()
        else:
            self.hits += 1
            CLAIMS.labels("hit").inc()
        HIT_RATIO.set(self.hits / (self.hits + self.misses))
        self._wake.set()
        return warm

    async def _refill_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.refill_delay_s)
            while len(self.ready) < self.target:
                try:
                    self.ready.append(await self._start_one())
                except Exception:
                    log.exception("could not start a warm kernel; retrying in 5 s")
                    await asyncio.sleep(5.0)

    async def _start_one(self) -> Warm:
        name = f"warm-{secrets.token_hex(4)}"
        slot = await asyncio.to_thread(self.new_slot, name)
        kernel = new_kernel(slot, name, "", KERNEL_NAME, self.sandbox, preimport=WARM_IMPORTS)
        try:
            await kernel.start()
        except BaseException:
            await kernel.shutdown()
            await asyncio.to_thread(slot.remove)
            raise
        return Warm(slot, kernel)

    async def discard(self, warm: Warm) -> None:
        """Stop a claimed kernel that will not be used, and remove its slot."""
        await self._discard(warm)

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
