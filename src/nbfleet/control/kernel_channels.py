"""A kernel's channels WebSocket: relayed verbatim to the agent that runs it.

A GPU workspace's frames pass the cell gate (``fleet/cellgate.py``), which binds
GPUs per cell. A resting kernel (its workspace suspended) accepts the connection
and holds it: the client's greetings (``kernel_info_request``, which every client
sends on connect and JupyterLab again at each automatic reconnect after the
suspend) do not wake the workspace, or a tab left open would undo every suspend;
its first other request does, and then runs on the restored state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import websockets
from fastapi import WebSocket

from nbfleet.agent.wire import V1_PROTOCOL
from nbfleet.control import channel_tickets, failover
from nbfleet.control.auth import Principal
from nbfleet.control.deps import principal_of_websocket
from nbfleet.control.fleet.cellgate import CellGate
from nbfleet.control.fleet.frames import Frame, open_client_frame
from nbfleet.control.fleet.inflight import CellsInFlight
from nbfleet.control.fleet.moves import request_move
from nbfleet.control.fleet.relay import STOPPED, GpuRelay, Location, Stopped
from nbfleet.control.kernels import kernel_placement, running_or_resting
from nbfleet.control.platform import Platform
from nbfleet.db.tables import Workspace
from nbfleet.model.errors import DomainError
from nbfleet.model.workspace import DesiredState
from nbfleet.web.problems import deny_websocket

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[Frame | None]]

#: What clients send on connecting: alone, these leave a resting kernel asleep.
GREETINGS = frozenset({"kernel_info_request", "comm_info_request"})
#: How the relay ends a client's socket when the kernel's side went away (a suspend,
#: a move, an agent restart): "service restart". JupyterLab gives up for good on a
#: normal closure (1000/1001), and would leave the notebook disconnected after a
#: suspend; on this code it reconnects, and the connection rests until it asks.
RECONNECT = 1012
#: Greetings held at most before the workspace is woken anyway (memory stays bounded).
MAX_HELD = 64
#: How often the relay pings the agent's side of a kernel's socket. A host that is
#: cut off (a partition, a frozen VM) resets no connection: without an answer to a
#: ping within the agent timeout, the relay takes the host as gone (the notebook is
#: told at once, not after TCP gives up) and follows the kernel where it is placed.
UPSTREAM_PING_S = 5.0


async def serve(websocket: WebSocket, workspace_id: str, kernel_id: str,
                ticket: str | None = None) -> None:
    """``ticket``: the channel ticket in the URL's path, for clients that cannot send
    credentials otherwise (``channel_tickets``)."""
    platform: Platform = websocket.app.state.platform
    try:
        principal = await asyncio.to_thread(_principal, platform, websocket, workspace_id,
                                            ticket)
        found = await running_or_resting(platform, principal, workspace_id, kernel_id)
    except DomainError as exc:
        await deny_websocket(websocket, exc)
        return
    wants_v1 = V1_PROTOCOL in (websocket.scope.get("subprotocols") or [])
    receive = _receiver(websocket)
    accepted = isinstance(found, dict)
    if isinstance(found, dict):
        # A resting kernel: the client gets a live socket at once; the workspace is
        # woken by the first request that is not a greeting, and what the client sent
        # waits until it runs.
        protocol = V1_PROTOCOL if wants_v1 else None
        await websocket.accept(subprotocol=protocol)
        held = await _hold(receive, protocol)
        if held is None:
            return  # the client left without asking for anything
        receive = _replaying(held, receive)
        try:
            where = await kernel_placement(platform, principal, workspace_id, kernel_id,
                                           wake=True)
        except DomainError as exc:
            log.info("kernel %s did not wake: %s", kernel_id, exc.detail)
            await websocket.close(code=1011, reason=exc.detail[:120])
            return
    else:
        where = found

    async def connect(where: Location) -> Any:
        # Offer the agent the client's protocol; frames then pass through untouched.
        return await websockets.connect(
            platform.agents.channels_url(where.host_url, kernel_id),
            additional_headers={"Authorization": f"Bearer {platform.config.secret}"},
            subprotocols=[V1_PROTOCOL] if wants_v1 else None,  # type: ignore[list-item]
            max_size=None,
            compression=None,
            open_timeout=10,
            ping_interval=UPSTREAM_PING_S,
            # As long as the control plane waits before it presumes a host dead: a
            # host slower than that to answer is taken as lost by both.
            ping_timeout=platform.config.agent_timeout_s,
        )

    here = Location(where.host_id, where.host_url)
    try:
        upstream = await connect(here)
    except (OSError, websockets.WebSocketException) as exc:
        log.warning("cannot reach kernel %s on %s: %s", kernel_id, where.host_url, exc)
        await websocket.close(code=1011, reason="kernel host unreachable")
        return
    if not accepted:
        await websocket.accept(subprotocol=upstream.subprotocol)
    cells = CellsInFlight(upstream.subprotocol)

    async def host_gone(host_id: str, send: Callable[[Frame], Awaitable[None]]) -> None:
        """Tell the client its unanswered cells will not run; keep what was seen."""
        count, last = len(cells.pending), cells.last_completed
        for frame in cells.interrupted(host_id):
            with contextlib.suppress(Exception):
                await send(frame)
        if count:
            try:
                await asyncio.to_thread(failover.record_cells, platform.db, workspace_id,
                                        kernel_id, host_id, last, count)
            except Exception:  # the client was told; only the restore's notice lacks it
                log.exception("could not record the cells %s left unanswered", host_id)

    if where.gpus == 0:
        if await _pump_both_ways(websocket, receive, upstream, cells):
            await host_gone(where.host_id, _sender(websocket))
            with contextlib.suppress(Exception):
                await websocket.close(code=RECONNECT)
        return

    async def locate() -> Location | Stopped | None:
        try:
            now = await kernel_placement(platform, principal, workspace_id, kernel_id)
        except DomainError:
            desired = await asyncio.to_thread(_desired_state, platform, workspace_id)
            return None if desired == DesiredState.RUNNING else STOPPED
        return Location(now.host_id, now.host_url)

    async def move(host_id: str) -> bool:
        moved = await asyncio.to_thread(request_move, platform.db, workspace_id, host_id)
        platform.wake()
        return moved

    async def changed() -> None:
        await platform.changed().wait()

    relay = GpuRelay(_sender(websocket), receive, upstream, here, locate, connect,
                     move, changed, cells, host_gone)
    async def interrupt() -> None:
        with contextlib.suppress(DomainError):
            await platform.agents.interrupt(relay.here.host_url, kernel_id)

    gate = relay.gate = CellGate(
        lambda: platform.fleet.scheduler, workspace_id, kernel_id, where.gpus,
        upstream.subprotocol, _sender(websocket), relay.to_kernel, relay.current_host,
        relay.move_to, platform.fleet.admit, interrupt)
    platform.fleet.gates.add(gate)
    gate.start()
    try:
        await relay.run()
    finally:
        platform.fleet.gates.remove(gate)
        await gate.close()
        with contextlib.suppress(Exception):
            await websocket.close(code=RECONNECT)


def _desired_state(platform: Platform, workspace_id: str) -> str | None:
    with platform.db.transaction(write=False) as session:
        ws = session.get(Workspace, workspace_id)
        return None if ws is None else ws.desired_state


def _receiver(client: WebSocket) -> Receive:
    async def receive() -> str | bytes | None:
        event = await client.receive()
        if event["type"] == "websocket.disconnect":
            return None
        data = event.get("text")
        return data if data is not None else event.get("bytes") or b""
    return receive


def _sender(client: WebSocket) -> Callable[[str | bytes], Awaitable[None]]:
    async def send(frame: str | bytes) -> None:
        if isinstance(frame, str):
            await client.send_text(frame)
        else:
            await client.send_bytes(frame)
    return send


def _principal(platform: Platform, websocket: WebSocket, workspace_id: str,
               ticket: str | None) -> Principal:
    if ticket is not None:
        return channel_tickets.principal(platform.db, platform.config.secret, ticket,
                                         workspace_id)
    return principal_of_websocket(platform, websocket)


async def _pump_both_ways(client: WebSocket, receive: Receive, upstream: Any,
                          cells: CellsInFlight) -> bool:
    """Until either side leaves; True when the kernel's side left with cells
    unanswered (the client is still connected, and the caller tells it)."""
    async def client_to_upstream() -> None:
        while (frame := await receive()) is not None:
            cells.sent(frame)
            await upstream.send(frame)

    client_gone = False

    async def upstream_to_client() -> None:
        nonlocal client_gone
        async for frame in upstream:
            cells.received(frame)
            try:
                if isinstance(frame, str):
                    await client.send_text(frame)
                else:
                    await client.send_bytes(frame)
            except Exception:  # the client left mid-output: not the kernel's host
                client_gone = True
                raise

    reader = asyncio.create_task(client_to_upstream())
    tasks = [reader, asyncio.create_task(upstream_to_client())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await upstream.close()
    if reader not in done and cells.pending and not client_gone:
        return True
    with contextlib.suppress(Exception):
        await client.close(code=RECONNECT)
    return False


async def _hold(receive: Receive, protocol: str | None) -> list[Frame] | None:
    """Frames up to and including the first that is not a greeting; None if the
    client leaves first."""
    held: list[Frame] = []
    while (frame := await receive()) is not None:
        held.append(frame)
        request = open_client_frame(frame, protocol)
        if request is None or request.msg_type not in GREETINGS or len(held) >= MAX_HELD:
            return held
    return None


def _replaying(held: list[Frame], receive: Receive) -> Receive:
    """``receive``, after the held frames, in order."""
    pending = list(held)

    async def replay() -> Frame | None:
        return pending.pop(0) if pending else await receive()
    return replay
