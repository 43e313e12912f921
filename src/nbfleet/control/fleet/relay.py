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
    _moving: asyncio.Event | None = None

    async def run(self) -> None:
        assert self.gate is not None
        reader = asyncio.create_task(self._client_to_gate())
        try:
            while True:
                current = self.upstream
                pump = asyncio.create_task(self._upstream_to_client(current))
                done, _ = await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await pump
                    return
                if self.upstream is not current:
                    continue  # a move already swapped in the new host's socket
                moving = self._moving
                if moving is not None:
                    await moving.wait()
                    if self.upstream is not current:
                        continue
                if self.cells is not None and self.cells.pending and self.host_gone:
                    self.gate.host_lost()
                    await self.host_gone(self.here.host_id, self._answer)
                if not await self._follow():
                    return  # the workspace stopped (suspended, deleted): so do we
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            with contextlib.suppress(Exception):
                await self.upstream.close()

    async def to_kernel(self, frame: Frame) -> None:
        if self._moving is not None and not self._moving.is_set():
            self._buffer.append(frame)
            return
        if self.cells is not None:
            self.cells.sent(frame)
        await self.upstream.send(frame)

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
        with a cell held; nothing else runs on the kernel meanwhile)."""
        moving = self._moving = asyncio.Event()
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
            old, self.upstream = self.upstream, await self.connect(where)
            self.here = where
            with contextlib.suppress(Exception):
                await old.close()
            buffered, self._buffer = self._buffer, []
            for frame in buffered:
                if self.cells is not None:
                    self.cells.sent(frame)
                await self.upstream.send(frame)
        finally:
            self._moving = None
            moving.set()

    async def _follow(self) -> bool:
        """The kernel's host closed its socket while the client is connected: if
        the workspace is being moved or placed again (a drain, a lost host), wait
        for it and reconnect; False when it is not meant to run any more."""
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
                    self.upstream, self.here = upstream, where
                    return True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self.changed()
        return False

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
