"""The WebSocket relay of a GPU workspace's kernel: a gate, and an upstream that
can change host under a connected client.

When the scheduler binds a cell's GPUs on another host, the kernel moves there
(``moves.py``) and the relay reconnects to it while the client stays connected:
the notebook sees a cell that took longer, not a dropped kernel. Frames the
client sends during the move wait for the new upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbfleet.control.fleet.cellgate import CellGate
from nbfleet.control.fleet.frames import Frame
from nbfleet.control.fleet.inflight import CellsInFlight

log = logging.getLogger(__name__)

#: How long a move may take before its cell is failed (saving and loading a large
#: state, starting a kernel cold).
MOVE_TIMEOUT_S = 180.0
#: Frames held at most while the relay changes sockets; a client that sends more
#: meanwhile loses the excess (each is logged), not the control plane's memory.
BUFFER_LIMIT = 1000
#: How long a move waits for the old socket's last frames to reach the client.
DRAIN_S = 10.0


class Upstream(Protocol):
    subprotocol: Any

    async def send(self, frame: Frame) -> None: ...
    async def close(self) -> None: ...
    def __aiter__(self) -> Any: ...


class MoveFailed(Exception):
    pass


class Stopped:
    """``locate``'s answer for a workspace that is not meant to run any more."""


STOPPED = Stopped()


@dataclass(frozen=True, slots=True)
class Location:
    host_id: str
    host_url: str


@dataclass
class GpuRelay:
    """Relays one client connection; ``locate`` answers where the kernel runs now
    (None while it is not running), ``connect`` opens the agent's socket there,
    ``request_move`` asks the reconciler to move the kernel to a host."""

    client_send: Callable[[Frame], Awaitable[None]]
    client_receive: Callable[[], Awaitable[Frame | None]]
    upstream: Upstream
    here: Location
    locate: Callable[[], Awaitable[Location | Stopped | None]]
    connect: Callable[[Location], Awaitable[Upstream]]
    request_move: Callable[[str], Awaitable[bool]]
    changed: Callable[[], Awaitable[None]]
    #: The cells sent and not answered, and what to do with them when the kernel's
    #: host goes away (``kernel_channels``: answer them with an error, record them).
    cells: CellsInFlight | None = None
    host_gone: Callable[[str, Callable[[Frame], Awaitable[None]]], Awaitable[None]] | None = None
    gate: CellGate | None = None
    _buffer: list[Frame] = field(default_factory=list)
    #: Set while the relay changes sockets (a move, or following a kernel placed
    #: again): frames wait in ``_buffer`` for the new one.
    _reconnecting: asyncio.Event | None = None
    #: The task reading the current socket (``run``): a move lets it finish reading
    #: the old one before it answers what that host left unanswered.
    _pump: asyncio.Task[None] | None = None

    async def run(self) -> None:
        assert self.gate is not None
        reader = asyncio.create_task(self._client_to_gate())
        try:
            while True:
                current = self.upstream
                pump = self._pump = asyncio.create_task(self._upstream_to_client(current))
                done, _ = await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
                if pump in done and not pump.cancelled() and pump.exception() is not None:
                    # Retrieved here: the kernel's side closed abnormally (a ping not
                    # answered, a reset), which the code below handles as any close.
                    log.info("kernel socket on %s closed: %s", self.here.host_id,
                             pump.exception())
                if reader in done:
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await pump
                    return
                if self.upstream is not current:
                    continue  # a move already swapped in the new host's socket
                moving = self._reconnecting
                if moving is not None:
                    await moving.wait()
                    if self.upstream is not current:
                        continue
                if not await self._follow():
                    return  # the workspace stopped (suspended, deleted): so do we
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            with contextlib.suppress(Exception):
                await self.upstream.close()

    async def to_kernel(self, frame: Frame) -> None:
        if self._reconnecting is not None and not self._reconnecting.is_set():
            if len(self._buffer) < BUFFER_LIMIT:
                self._buffer.append(frame)
            else:
                log.warning("dropping a frame for kernel on %s: %d already wait for "
                            "its new socket", self.here.host_id, BUFFER_LIMIT)
            return
        await self._send(frame)

    async def _send(self, frame: Frame) -> None:
        refused = (self.cells.sent(frame, self.here.host_id) if self.cells is not None
                   else None)
        if refused is not None:
            msg_id, answers = refused
            assert self.gate is not None
            self.gate.host_lost({msg_id})
            for answer in answers:
                await self._answer(answer)
            return
        try:
            await self.upstream.send(frame)
        except Exception as exc:
            # The kernel's socket closed under us: its pump sees that too, and the
            # cell just sent is answered with the others the host never answered.
            log.info("sending to kernel on %s failed: %s", self.here.host_id, exc)

    async def _answer(self, frame: Frame) -> None:
        """A reply of our own for a cell the lost host never answered: the gate
        releases its GPUs and lets the next cell go, as on the kernel's reply."""
        assert self.gate is not None
        self.gate.from_kernel(frame)
        await self.client_send(frame)

    def current_host(self) -> str:
        return self.here.host_id

    async def move_to(self, host_id: str) -> None:
        """Move the kernel to ``host_id`` and reconnect there (the gate calls this
        with a cell held; nothing else runs on the kernel meanwhile). While the relay
        is following the kernel to a new host (its old one went), the move waits for
        that first: the kernel may already be where the cell's GPUs are, and two
        reconnections at once would leave the cell's reply on a socket nobody reads."""
        while self._reconnecting is not None:
            await self._reconnecting.wait()
        if self.here.host_id == host_id:
            return
        moving = self._reconnecting = asyncio.Event()
        try:
            if not await self.request_move(host_id):
                raise MoveFailed("the workspace is not running steadily (being suspended, "
                                 "deleted or already moving)")
            deadline = time.monotonic() + MOVE_TIMEOUT_S
            while True:
                where = await self.locate()
                if isinstance(where, Location) and where.host_id == host_id:
                    break
                if where is STOPPED:
                    raise MoveFailed("the workspace was suspended or deleted meanwhile")
                if time.monotonic() > deadline:
                    raise MoveFailed(f"the kernel did not come up on {host_id} within "
                                     f"{MOVE_TIMEOUT_S:.0f} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.changed()
            upstream = await self.connect(where)
            # What the old socket still holds reaches the client before the cells it
            # left unanswered are answered (a host cut off never closes it: bounded).
            with contextlib.suppress(Exception):
                await self.upstream.close()
            pump = self._pump
            if pump is not None and not pump.done():
                await asyncio.wait({pump}, timeout=DRAIN_S)
            await self._reconnected(upstream, where)
        finally:
            self._reconnecting = None  # no await since the flush: nothing is left held
            moving.set()

    async def _reconnected(self, upstream: Upstream, where: Location) -> None:
        """The kernel's socket on its new host: cells the old one never answered are
        answered first, then the frames sent meanwhile go on (those sent during the
        flush too). A cell bound to the old host's GPUs is answered, not sent
        (``_send``). The caller ends the reconnection with no await after this."""
        await self._answer_unanswered()
        self.upstream, self.here = upstream, where
        while self._buffer:
            held, self._buffer = self._buffer, []
            for frame in held:
                await self._send(frame)

    async def _answer_unanswered(self) -> None:
        """The kernel's host went (lost, cut off, or left behind by a move) with cells
        it never answered: the client is told they will not run again."""
        if self.cells is None or not self.cells.pending or self.host_gone is None:
            return
        assert self.gate is not None
        self.gate.host_lost(set(self.cells.pending))
        await self.host_gone(self.here.host_id, self._answer)

    async def _follow(self) -> bool:
        """The kernel's host closed its socket while the client is connected: its
        unanswered cells are answered at once; then, if the workspace is being moved
        or placed again (a drain, a lost host), wait for it and reconnect; False when
        it is not meant to run any more. Frames sent meanwhile wait for the new
        socket, as during a move."""
        following = self._reconnecting = asyncio.Event()
        try:
            await self._answer_unanswered()
            deadline = time.monotonic() + MOVE_TIMEOUT_S
            while time.monotonic() < deadline:
                where = await self.locate()
                if where is STOPPED:
                    return False
                if isinstance(where, Location):
                    try:
                        upstream = await self.connect(where)
                    except Exception as exc:  # not up yet on that host: look again
                        log.info("reconnecting to %s: %s", where.host_id, exc)
                    else:
                        await self._reconnected(upstream, where)
                        return True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.changed()
            return False
        finally:
            self._reconnecting = None
            following.set()

    async def _client_to_gate(self) -> None:
        assert self.gate is not None
        while True:
            frame = await self.client_receive()
            if frame is None:
                return
            await self.gate.from_client(frame)

    async def _upstream_to_client(self, upstream: Upstream) -> None:
        assert self.gate is not None
        async for frame in upstream:
            if self.cells is not None:
                self.cells.received(frame)
            self.gate.from_kernel(frame)
            await self.client_send(frame)
