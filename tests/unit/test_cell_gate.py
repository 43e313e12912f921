"""The cell gate (control/fleet/cellgate.py) with a real live scheduler: a cell's
GPUs go back when its connection closes before the cell reached the kernel."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nbfleet.control.fleet.cellgate import CellGate
from nbfleet.control.fleet.scheduler import Binding, LiveScheduler
from tests.unit.test_live_scheduler import A100, committed, scheduler


async def test_a_cell_whose_connection_closes_during_its_move_gives_its_gpus_back() -> None:
    live: LiveScheduler = scheduler(hosts=1)
    assert live.open_kernel("ws1", A100) == ("h0",)
    moving = asyncio.Event()
    sent: list[Any] = []

    async def move_to(host_id: str) -> None:
        moving.set()
        await asyncio.Event().wait()  # the kernel takes its time to come up there

    async def admit(binding: Binding, on_refused: Any) -> str | None:
        return None

    async def collect(frame: Any) -> None:
        sent.append(frame)

    async def nothing() -> None:
        return None

    gate = CellGate(lambda: live, "ws1", "k1", 1, None, collect, collect,
                    lambda: "h-elsewhere", move_to, admit, nothing)
    gate.start()
    await gate.from_client(json.dumps({
        "header": {"msg_id": "m1", "msg_type": "execute_request"}, "parent_header": {},
        "metadata": {}, "channel": "shell", "content": {"code": "x = 1"}}))
    await asyncio.wait_for(moving.wait(), 5)
    assert committed(live) == 1  # bound on h0, the kernel on its way there
    await gate.close()  # the notebook disconnected mid-move
    assert committed(live) == 0, "the GPU of a cell that never ran is given back"
