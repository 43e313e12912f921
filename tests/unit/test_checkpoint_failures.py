"""Which checkpoint outcomes are failures the user is told of (``agent/checkpoints``).

A request that times out because a client's cell came first and the request waits
behind it is no failure: that cell's reply asks again. One that times out with
nothing else in the kernel is."""

from __future__ import annotations

import asyncio
from typing import Any

from nbfleet.agent import checkpoints


class _Kernel:
    """What ``_flush`` reads of a kernel, with a request that never answers."""

    def __init__(self, cell_arrives: bool) -> None:
        self.state_dir = "/nonexistent"
        self.restarts = 0
        self.execution_state = "idle"
        self.cells_pending: set[str] = set()
        self.cell_arrives = cell_arrives

    async def execute_internal(self, code: str, timeout: float,
                               expressions: dict[str, str]) -> dict[str, Any]:
        if self.cell_arrives:
            self.cells_pending.add("m-client")  # sent just before ours: ours waits
        raise TimeoutError


def test_a_request_stuck_behind_a_client_cell_is_no_failure() -> None:
    flushed = asyncio.run(checkpoints._flush(_Kernel(cell_arrives=True), 1))  # type: ignore[arg-type]
    assert flushed.failure is None and flushed.cell is None


def test_a_request_the_idle_kernel_never_takes_is_a_failure() -> None:
    flushed = asyncio.run(checkpoints._flush(_Kernel(cell_arrives=False), 1))  # type: ignore[arg-type]
    assert flushed.failure is not None and "did not take the request" in flushed.failure
