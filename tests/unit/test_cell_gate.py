"""The cell gate (control/fleet/cellgate.py) with a real live scheduler: a cell's
GPUs go back when its connection closes before the cell reached the kernel."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from nbfleet.control.fleet.cellgate import CellGate
from nbfleet.control.fleet.scheduler import Binding, LiveScheduler
from nbfleet.protocol.gpu import BINDING_KEY
from tests.unit.test_live_scheduler import A100, ONE_A100, committed, scheduler


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


class _Kernel:
    """The kernel side of a gate: what reached it, and its replies."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self.to_client: list[dict[str, Any]] = []

    async def to_kernel(self, frame: Any) -> None:
        self.requests.append(json.loads(frame))
        self.arrived.set()

    async def collect(self, frame: Any) -> None:
        self.to_client.append(json.loads(frame))

    def reply(self, gate: CellGate, msg_id: str) -> None:
        gate.from_kernel(json.dumps({  # as the agent writes them: channel last, compact
            "header": {"msg_id": f"r-{msg_id}", "msg_type": "execute_reply"},
            "parent_header": {"msg_id": msg_id}, "metadata": {},
            "content": {"status": "ok"}, "buffers": [], "channel": "shell"},
            separators=(",", ":")))

    async def next_binding(self) -> dict[str, Any]:
        await asyncio.wait_for(self.arrived.wait(), 5)
        self.arrived.clear()
        binding: dict[str, Any] = self.requests[-1]["metadata"][BINDING_KEY]
        return binding


def _gate(live: LiveScheduler, kernel: _Kernel, ended: list[str]) -> CellGate:
    async def admit(binding: Binding, on_refused: Any) -> str | None:
        return None

    async def nothing(*args: Any) -> None:
        return None

    live.effects.cell_ended = ended.append  # type: ignore[method-assign]
    gate = CellGate(lambda: live, "ws1", "k1", 1, None, kernel.collect, kernel.to_kernel,
                    lambda: "h0", nothing, admit, nothing)
    gate.start()
    return gate


async def _cell(gate: CellGate, msg_id: str) -> None:
    await gate.from_client(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request"}, "parent_header": {},
        "metadata": {}, "channel": "shell", "content": {"code": "x = 1"}}))


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _one_cell_replied(gpu_holds: bool = True,
                            ) -> tuple[LiveScheduler, _Kernel, list[str], CellGate, dict[str, Any]]:
    """Two GPU workspaces on a one-GPU host; ws1's first cell has replied."""
    live: LiveScheduler = scheduler(hosts=1)
    live.host_lost("h0")
    live.host_joined("h0", dataclasses.replace(ONE_A100, gpu_holds=gpu_holds))
    assert live.open_kernel("ws1", A100) == ("h0",)
    assert live.open_kernel("ws2", A100) == ("h0",)
    kernel, ended = _Kernel(), []
    gate = _gate(live, kernel, ended)
    await _cell(gate, "m1")
    first = await kernel.next_binding()
    kernel.reply(gate, "m1")
    await _settle()
    return live, kernel, ended, gate, first


async def test_a_cells_gpus_stay_committed_and_billed_after_its_reply_until_the_agent_reports(
) -> None:
    live, _, ended, gate, first = await _one_cell_replied()
    # Replied, not reported: a process of the cell may still hold the GPU open.
    assert committed(live) == 1 and ended == []
    assert live.running["k1/m1"].replied_at is not None
    other = asyncio.create_task(live.acquire("ws2/c1", "ws2", 1))
    await _settle()
    assert not other.done(), "another tenant is never bound to a GPU not yet reported closed"
    live.release("k1/m1")  # the agent's report: closed
    binding = await asyncio.wait_for(other, 5)
    assert binding.gpu_indices == tuple(first["gpu_indices"]) and ended == ["k1/m1"]
    await gate.close()


async def test_the_next_cell_takes_over_gpus_its_kernel_still_holds_open() -> None:
    live, kernel, ended, gate, first = await _one_cell_replied()
    waiting = asyncio.create_task(live.acquire("ws2/c1", "ws2", 1))  # another tenant
    await _cell(gate, "m2")
    await _settle()
    assert len(kernel.requests) == 1, "the next cell waits for the agent's report"
    live.held("k1/m1")  # the agent: ended, a CUDA context still holds the GPU
    second = await kernel.next_binding()
    assert second["gpu_indices"] == first["gpu_indices"] and second["task_id"] == "k1/m2"
    assert set(live.running) == {"k1/m2"} and ended == ["k1/m1"]
    assert not waiting.done(), "the held GPU never went back to the queue"
    kernel.reply(gate, "m2")
    await _settle()
    live.release("k1/m2")  # the kernel closed it at last
    assert (await asyncio.wait_for(waiting, 5)).gpu_indices == tuple(first["gpu_indices"])
    await gate.close()


async def test_a_new_connection_takes_over_a_gpu_an_earlier_one_left_held() -> None:
    live, kernel, ended, gate, first = await _one_cell_replied()
    await gate.close()
    live.held("k1/m1")
    again = _gate(live, kernel, ended)
    await _cell(again, "m2")
    second = await kernel.next_binding()
    assert second["gpu_indices"] == first["gpu_indices"] and set(live.running) == {"k1/m2"}
    await again.close()


async def test_where_nothing_can_hold_a_gpu_past_its_cell_it_is_free_at_the_reply() -> None:
    """A host whose slots have no GPU nodes (GPUs only declared), or no cgroup to
    look for holders in, never reports a hold: waiting for its report would only
    slow every cell down."""
    live, _, ended, gate, _first = await _one_cell_replied(gpu_holds=False)
    assert committed(live) == 0 and ended == ["k1/m1"]
    await gate.close()
