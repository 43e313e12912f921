"""The GPU relay changing sockets under a connected client (control/fleet/relay.py):
a kernel whose host went is followed once, whatever the gate asks meanwhile, and a
cell let through to a host that is gone is answered, never lost or run elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any

import pytest

from nbfleet.agent.wire import V1_PROTOCOL, pack_v1
from nbfleet.control.fleet.inflight import CellsInFlight
from nbfleet.control.fleet.relay import GpuRelay, Location, Stopped
from nbfleet.protocol.gpu import BINDING_KEY


class FakeUpstream:
    """An agent's kernel socket: what was sent to it, and frames it sends back."""

    subprotocol = None

    def __init__(self, host: str, send_delay_s: float = 0.0) -> None:
        self.host = host
        self.sent: list[Any] = []
        self.incoming: asyncio.Queue[str | None] = asyncio.Queue()
        self.closed = False
        self.send_delay_s = send_delay_s

    async def send(self, frame: Any) -> None:
        if self.closed:
            raise ConnectionError("the kernel's socket is closed")
        if self.send_delay_s:
            await asyncio.sleep(self.send_delay_s)  # a socket under backpressure
        self.sent.append(frame)

    async def close(self) -> None:
        self.closed = True
        self.incoming.put_nowait(None)

    def __aiter__(self) -> FakeUpstream:
        return self

    async def __anext__(self) -> str:
        item = await self.incoming.get()
        if item is None:
            raise StopAsyncIteration
        return item


class FakeGate:
    def __init__(self) -> None:
        self.lost: set[str] = set()
        self.replies: list[Any] = []

    async def from_client(self, frame: Any) -> None:
        raise AssertionError("no client frames in these tests")

    def from_kernel(self, frame: Any) -> None:
        self.replies.append(frame)

    def host_lost(self, msg_ids: set[str]) -> None:
        self.lost |= msg_ids


def binding(host: str) -> dict[str, Any]:
    return {BINDING_KEY: {"task_id": f"k/{uuid.uuid4().hex}", "host_id": host,
                          "gpu_indices": [0], "gpu_type": "A100-80GB"}}


def execute(code: str, bound_to: str) -> tuple[str, str]:
    """A cell as the gate lets it through: bound to ``bound_to``'s GPUs."""
    msg_id = uuid.uuid4().hex
    return msg_id, json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request"},
                               "parent_header": {}, "metadata": binding(bound_to),
                               "channel": "shell", "content": {"code": code}})


def reply(msg_id: str) -> str:
    """As the agent writes a shell reply (compact, the channel last)."""
    return json.dumps({"header": {"msg_type": "execute_reply"},
                       "parent_header": {"msg_id": msg_id}, "content": {"status": "ok"},
                       "channel": "shell"}, separators=(",", ":"))


def info(msg_id: str = "k") -> str:
    return json.dumps({"header": {"msg_id": msg_id, "msg_type": "kernel_info_request"},
                       "channel": "shell", "content": {}})


class Fleet:
    """Where the kernel runs (the test moves it) and the sockets opened to it."""

    def __init__(self, send_delay_s: float = 0.0) -> None:
        self.where: Location | Stopped | None = Location("h1", "http://h1")
        self.opened: list[FakeUpstream] = []
        self.send_delay_s = send_delay_s
        #: Cleared to hold the client's side (a slow client): the relay's pump waits.
        self.client_reads = asyncio.Event()
        self.client_reads.set()
        self.moves: list[str] = []
        self.changes = asyncio.Event()
        self.gone: list[str] = []
        self.to_client: list[Any] = []

    async def locate(self) -> Location | Stopped | None:
        return self.where

    async def connect(self, where: Location) -> FakeUpstream:
        upstream = FakeUpstream(where.host_id, self.send_delay_s)
        self.opened.append(upstream)
        return upstream

    async def request_move(self, host_id: str) -> bool:
        self.moves.append(host_id)
        return True

    async def changed(self) -> None:
        await self.changes.wait()
        self.changes.clear()

    def place(self, where: Location | None) -> None:
        self.where = where
        self.changes.set()

    async def client_send(self, frame: Any) -> None:
        await self.client_reads.wait()
        self.to_client.append(frame)

    async def client_receive(self) -> Any:
        await asyncio.Event().wait()  # the client stays connected, silent

    def relay(self, first: FakeUpstream) -> tuple[GpuRelay, FakeGate]:
        cells = CellsInFlight(None)

        async def host_gone(host_id: str, send: Any) -> None:
            self.gone.append(host_id)
            for frame in cells.interrupted(host_id):
                await send(frame)
        relay = GpuRelay(self.client_send, self.client_receive, first,
                         Location("h1", "http://h1"), self.locate, self.connect,
                         self.request_move, self.changed, cells, host_gone)
        gate = FakeGate()
        relay.gate = gate  # type: ignore[assignment]
        return relay, gate


def replies_to(frames: list[Any], msg_id: str) -> list[dict[str, Any]]:
    messages = [json.loads(f) for f in frames]
    return [m for m in messages if m.get("parent_header", {}).get("msg_id") == msg_id
            and m["header"]["msg_type"] == "execute_reply"]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def running_relay_whose_host_died(fleet: Fleet) -> tuple[GpuRelay, FakeGate,
                                                                  asyncio.Task[None]]:
    """A relay running on h1, whose host has just died while the kernel is being
    placed again (nowhere yet): the relay is following it."""
    relay, gate, running, first = await running_relay(fleet)
    fleet.where = None
    await first.close()
    await settle()
    return relay, gate, running


async def running_relay(fleet: Fleet) -> tuple[GpuRelay, FakeGate, asyncio.Task[None],
                                               FakeUpstream]:
    """A relay running on h1: it, its gate, its task and h1's socket."""
    first = FakeUpstream("h1")
    relay, gate = fleet.relay(first)
    running = asyncio.create_task(relay.run())
    await settle()
    return relay, gate, running, first


async def test_a_move_asked_while_the_relay_follows_a_lost_host_does_not_reconnect_twice(
        ) -> None:
    """The kernel's host dies; before the relay has reconnected to where the kernel
    was placed again, the gate gets the next cell's GPUs on that host and asks to move
    there. The relay follows once, and the cell goes on the socket it reads."""
    fleet = Fleet()
    relay, _, running = await running_relay_whose_host_died(fleet)
    move = asyncio.create_task(relay.move_to("h2"))
    await settle()
    fleet.place(Location("h2", "http://h2"))
    await asyncio.wait_for(move, 5)
    msg_id, cell = execute("x = 1", bound_to="h2")
    await relay.to_kernel(cell)
    assert [u.host for u in fleet.opened] == ["h2"], "one socket to the new host"
    assert fleet.moves == [], "the kernel was already there: nothing to move"
    (only,) = fleet.opened
    assert only.sent == [cell]
    only.incoming.put_nowait(reply(msg_id))
    await settle()
    assert reply(msg_id) in fleet.to_client, "the reply reaches the client"
    await stop(running)


async def test_a_cell_bound_to_the_lost_host_is_answered_not_run_elsewhere() -> None:
    """Let through to the lost host's GPUs while the relay follows the kernel, the
    cell waits with the other frames, is answered HostLost when the new socket opens
    and never reaches the kernel's next host; the other frames go there in order."""
    fleet = Fleet()
    relay, gate, running = await running_relay_whose_host_died(fleet)
    msg_id, cell = execute("y = 2", bound_to="h1")
    await relay.to_kernel(info("a"))
    await relay.to_kernel(cell)
    await relay.to_kernel(info("b"))
    assert not replies_to(fleet.to_client, msg_id), "held until the new socket"
    fleet.place(Location("h2", "http://h2"))
    await settle()
    (answer,) = replies_to(fleet.to_client, msg_id)
    assert answer["content"]["ename"] == "HostLost", answer
    assert "(h1)" in answer["content"]["evalue"] and "did not run" in answer["content"]["evalue"]
    assert msg_id in gate.lost  # the cells queued behind it abort
    (second,) = fleet.opened
    assert second.sent == [info("a"), info("b")]
    await stop(running)


async def test_a_cell_bound_to_another_host_is_never_sent_even_once_the_relay_is_there(
        ) -> None:
    """The gate checked the host before an await (the metering); the relay followed
    the kernel meanwhile. The cell's binding names the old host: not sent."""
    fleet = Fleet()
    relay, gate = fleet.relay(FakeUpstream("h2"))
    relay.here = Location("h2", "http://h2")
    msg_id, cell = execute("z = 3", bound_to="h1")
    await relay.to_kernel(cell)
    assert relay.upstream.sent == []  # type: ignore[attr-defined]
    (answer,) = replies_to(fleet.to_client, msg_id)
    assert answer["content"]["ename"] == "HostLost"
    assert msg_id in gate.lost


async def test_frames_sent_while_held_frames_are_flushed_are_not_left_behind() -> None:
    """The new socket is slow to take the held frames; what the client sends during
    that flush goes after them, not into a buffer nobody empties."""
    fleet = Fleet(send_delay_s=0.01)
    relay, _, running = await running_relay_whose_host_died(fleet)
    for name in ("a", "b"):
        await relay.to_kernel(info(name))
    fleet.place(Location("h2", "http://h2"))
    await asyncio.sleep(0.005)  # the flush is under way
    await relay.to_kernel(info("c"))
    await asyncio.sleep(0.1)
    (second,) = fleet.opened
    assert second.sent == [info("a"), info("b"), info("c")]
    await stop(running)


async def test_a_move_lets_the_old_socket_finish_before_answering_what_it_left() -> None:
    """The client is slow: the reply to cell A is still in the old socket when the
    gate moves the kernel for the next cell. A gets its one reply, from the kernel,
    not a HostLost as well; nothing is recorded as lost."""
    fleet = Fleet()
    relay, _, running, first = await running_relay(fleet)
    msg_id, cell = execute("a = 1", bound_to="h1")
    await relay.to_kernel(cell)
    fleet.client_reads.clear()
    first.incoming.put_nowait(info("output"))  # the pump holds this one
    first.incoming.put_nowait(reply(msg_id))
    await settle()
    move = asyncio.create_task(relay.move_to("h2"))
    fleet.place(Location("h2", "http://h2"))
    await settle()
    fleet.client_reads.set()
    await asyncio.wait_for(move, 5)
    assert [m["content"].get("status") for m in replies_to(fleet.to_client, msg_id)] == ["ok"]
    assert fleet.gone == []
    assert fleet.moves == ["h2"]
    await stop(running)


async def test_a_cell_running_when_the_host_went_is_answered_once() -> None:
    fleet = Fleet()
    relay, gate, running, first = await running_relay(fleet)
    msg_id, cell = execute("import time; time.sleep(60)", bound_to="h1")
    await relay.to_kernel(cell)
    fleet.where = None
    await first.close()
    await settle()
    (answer,) = replies_to(fleet.to_client, msg_id)
    assert "it was interrupted" in answer["content"]["evalue"]
    assert fleet.gone == ["h1"] and gate.lost == {msg_id}
    fleet.place(Location("h2", "http://h2"))
    await settle()
    assert len(replies_to(fleet.to_client, msg_id)) == 1
    assert [u.host for u in fleet.opened] == ["h2"]
    await stop(running)


@pytest.mark.parametrize("protocol", [None, V1_PROTOCOL])
def test_a_cell_is_refused_only_when_bound_to_another_host(protocol: str | None) -> None:
    cells = CellsInFlight(protocol)
    header = {"msg_id": "m1", "msg_type": "execute_request"}

    def frame(metadata: dict[str, Any]) -> str | bytes:
        if protocol == V1_PROTOCOL:
            parts = [json.dumps(p).encode() for p in (header, {}, metadata, {"code": ""})]
            return pack_v1("shell", parts, [])
        return json.dumps({"header": header, "parent_header": {}, "metadata": metadata,
                           "channel": "shell", "content": {"code": ""}})

    assert cells.sent(frame(binding("h1")), "h1") is None
    assert cells.sent(frame({}), "h2") is None  # no binding: not ours to judge
    assert list(cells.pending) == ["m1"]
    cells.pending.clear()
    found = cells.sent(frame(binding("h1")), "h2")
    assert found is not None and found[0] == "m1" and len(found[1]) == 3
    assert not cells.pending, "a cell that may not go is not waited for"


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
