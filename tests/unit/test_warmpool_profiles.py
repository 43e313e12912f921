"""The warm pool's prepared kernels and its refill, with fake kernels.

A kernel prepared with a workspace's imports goes only to a workspace whose own
imports contain them; the pool keeps one for the most recent import sets; its
refill waits while resumes are being placed (a burst).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from nbfleet.agent.warmpool import Warm, WarmPool

pytestmark = pytest.mark.no_db

SK = frozenset({"sklearn", "sklearn.linear_model"})
SP = frozenset({"sympy"})


@dataclass
class FakeKernel:
    execution_state: str = "idle"
    stopped: bool = False

    async def shutdown(self) -> None:
        self.stopped = True


@dataclass
class FakeSlot:
    removed: list[bool] = field(default_factory=list)

    def remove(self) -> None:
        self.removed.append(True)


def warm(modules: frozenset[str] = frozenset()) -> Warm:
    return Warm(FakeSlot(), FakeKernel(), modules)  # type: ignore[arg-type]


def pool(target: int = 1, profiles: int | None = None, delay: float = 0.0) -> WarmPool:
    return WarmPool(target, lambda name: None, None, refill_delay_s=delay,  # type: ignore
                    profiles=profiles)


def test_a_prepared_kernel_goes_only_to_a_workspace_that_imports_all_of_it() -> None:
    async def main() -> None:
        p = pool(target=1, profiles=2)
        plain, sk, both = warm(), warm(SK), warm(SK | SP)
        p.ready = [plain, sk, both]
        p.demand.update({SK: 1, SK | SP: 1})
        assert p.claim("python3", SP) is plain  # no sklearn in it: the plain one
        assert p.claim("python3", SK | SP | {"numpy"}) is both  # the most modules
        assert p.claim("python3", frozenset()) is None  # sk is not for it
        assert p.claim("ir", SK) is None  # another kernel spec
        assert p.claim("python3", SK) is sk
        assert p.ready == [] and p.demand == {}
        assert (p.hits, p.misses) == (3, 2)

    asyncio.run(main())


def test_a_dead_kernel_is_never_handed_out() -> None:
    async def main() -> None:
        p = pool()
        dead, alive = warm(SK), warm()
        dead.kernel.execution_state = "dead"
        p.ready = [dead, alive]
        assert p.claim("python3", SK) is alive
        await asyncio.sleep(0.05)
        assert dead.kernel.stopped  # type: ignore[attr-defined]

    asyncio.run(main())


def test_the_pool_keeps_the_most_recent_import_sets_only() -> None:
    async def main() -> None:
        p = pool(target=0)
        p.prepare(SK)  # a pool turned off prepares nothing
        assert p.demand == {}
        p = pool(target=1, profiles=1)
        p.start = lambda: None  # type: ignore[method-assign]
        old = warm(SK)
        p.ready = [warm(), old]
        p.prepare(SK)
        p.prepare(SK)
        assert p.demand == {SK: 2}
        p.prepare(SP)  # evicts sklearn's set, and stops its kernel
        assert list(p.demand) == [SP] and p.ready[1:] == []
        await asyncio.sleep(0.05)
        assert old.kernel.stopped  # type: ignore[attr-defined]
        p.prepare(frozenset())  # nothing heavy: nothing to prepare
        assert list(p.demand) == [SP]

    asyncio.run(main())


def test_the_refill_starts_plain_kernels_first_then_prepared_ones() -> None:
    async def main() -> None:
        p = pool(target=2, profiles=2)
        started = recording(p)
        p.demand.update({SK: 1, SP: 3})
        p.start()
        for _ in range(50):
            await asyncio.sleep(0.01)
        assert started == [frozenset(), frozenset(), SP, SK]  # the most recent set first
        assert p.claim("python3", SK) is not None and p.demand == {SP: 3}
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert started[4:] == []  # sklearn's set was consumed: not prepared again
        assert p.claim("python3") is not None
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert started[4:] == [frozenset()]
        await p.shutdown()

    asyncio.run(main())


def test_a_set_whose_kernel_does_not_start_is_dropped() -> None:
    async def main() -> None:
        p = pool(target=0, profiles=1)
        calls: list[Any] = []

        async def start_one(modules: frozenset[str] = frozenset()) -> Warm:
            calls.append(modules)
            raise RuntimeError("the kernel exited during start-up")

        p._start_one = start_one  # type: ignore[method-assign]
        p.demand[SK] = 1
        p._task = asyncio.create_task(p._refill_forever())
        p._wake.set()
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert calls == [SK] and p.demand == {}
        await p.shutdown()

    asyncio.run(main())


def recording(p: WarmPool) -> list[frozenset[str]]:
    """The import sets of the kernels ``p`` starts (no real kernel is started)."""
    started: list[frozenset[str]] = []

    async def start_one(modules: frozenset[str] = frozenset()) -> Warm:
        started.append(modules)
        return warm(modules)

    p._start_one = start_one  # type: ignore[method-assign]
    return started


def test_the_refill_waits_for_claims_to_stop_not_for_placements() -> None:
    async def main() -> None:
        p = pool(target=1, delay=0.2)
        started = recording(p)
        p.start()
        await asyncio.sleep(0.05)
        assert started == [frozenset()]  # no claim yet: at once
        assert p.claim("python3") is not None
        await asyncio.sleep(0.05)
        assert started == [frozenset()]  # not at once after a claim
        await asyncio.sleep(0.3)
        assert started == [frozenset(), frozenset()]
        await p.shutdown()

    asyncio.run(main())
