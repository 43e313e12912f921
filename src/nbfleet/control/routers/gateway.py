"""The Jupyter Kernel Gateway API, scoped to one workspace.

A workspace's gateway URL is ``{base}/v1/workspaces/{id}``; point
``jupyter server --gateway-url`` (or JupyterLab, VS Code, nbclient) at it. Frames on
``/api/kernels/{id}/channels`` are relayed verbatim to the agent that runs the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import websockets
from fastapi import APIRouter, Depends, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from nbfleet.agent.wire import V1_PROTOCOL
from nbfleet.control import hosts, workspaces
from nbfleet.control.auth import Principal, resolve
from nbfleet.control.deps import current_principal, platform_of, token_of
from nbfleet.control.fleet.cellgate import CellGate
from nbfleet.control.fleet.moves import request_move
from nbfleet.control.fleet.relay import STOPPED, GpuRelay, Location, Stopped
from nbfleet.control.platform import Platform
from nbfleet.db.tables import Agent, Kernel, Workspace
from nbfleet.model.errors import Conflict, DomainError, InvalidInput, NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.protocol.agent import KernelModel
from nbfleet.web.problems import deny_websocket

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/workspaces/{workspace_id}", tags=["kernel gateway"])

JUPYTER_FIELDS = ("id", "name", "last_activity", "execution_state", "connections")


class StartKernel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # GatewayClient also sends KERNEL_* env
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    host_url: str
    generation: int
    kernel_ids: tuple[str, ...]
    specs: dict[str, Any]
    #: GPUs each cell binds (0: the workspace has none, and its frames pass untouched).
    gpus: int = 0
    host_id: str = ""


def _placement(platform: Platform, principal: Principal, workspace_id: str) -> Placement:
    """Where the workspace runs now; 409 naming its state when it is not running."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        if ws.state != WorkspaceState.RUNNING:
            raise Conflict(f"workspace is {ws.state}; resume it to use kernels",
                           current_state=ws.state)
        now = platform.db.now(session)
        agent = hosts.alive_agent(session, ws.host_id, now, platform.config.agent_timeout_s)
        if agent is None or agent.boot_id != ws.host_boot_id:
            raise Conflict("workspace runtime is being re-placed; retry shortly",
                           current_state=ws.state)
        kernel_ids = tuple(
            session.execute(select(Kernel.id).where(Kernel.workspace_id == ws.id)).scalars()
        )
        specs = dict(agent.inventory.get("kernelspecs", {}))
        return Placement(agent.url, ws.generation, kernel_ids, specs,
                         workspaces.resources_of(ws).gpus, agent.id)


def _any_specs(platform: Platform, principal: Principal, workspace_id: str) -> dict[str, Any]:
    """Kernelspecs are listed even while suspended: from any host's inventory."""
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)
        for inventory in session.execute(select(Agent.inventory)).scalars():
            if inventory.get("kernelspecs"):
                return dict(inventory["kernelspecs"])
    return {}


def _jupyter_model(model: KernelModel) -> dict[str, Any]:
    return model.model_dump(mode="json", include=set(JUPYTER_FIELDS))


def _default_spec(specs: dict[str, Any]) -> str:
    return "python3" if "python3" in specs else next(iter(specs), "python3")


@router.get("/api/kernelspecs", summary="List kernelspecs")
async def list_kernelspecs(workspace_id: str, request: Request,
                           principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    specs = await asyncio.to_thread(_any_specs, platform_of(request), principal, workspace_id)
    return {"default": _default_spec(specs), "kernelspecs": specs}


@router.get("/api/kernelspecs/{name}", summary="Get a kernelspec")
async def get_kernelspec(workspace_id: str, name: str, request: Request,
                         principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    specs = await asyncio.to_thread(_any_specs, platform_of(request), principal, workspace_id)
    if name not in specs:
        raise NotFound(f"no kernelspec {name!r}")
    spec: dict[str, Any] = specs[name]
    return spec


@router.get("/kernelspecs/{name}/{path:path}", summary="Kernelspec resources (none served)")
async def kernelspec_resource(workspace_id: str, name: str, path: str,
                              principal: Principal = Depends(current_principal)) -> Response:
    raise NotFound(f"kernelspec {name} has no resource {path}")


@router.get("/api/kernels", summary="List the workspace's kernels")
async def list_kernels(workspace_id: str, request: Request,
                       principal: Principal = Depends(current_principal)) -> list[dict[str, Any]]:
    platform = platform_of(request)
    try:
        where = await asyncio.to_thread(_placement, platform, principal, workspace_id)
    except Conflict:
        return []  # a suspended workspace has no live kernels
    mine = set(where.kernel_ids)
    models = await platform.agents.kernels(where.host_url)
    return [_jupyter_model(m) for m in models if m.id in mine]


@router.post("/api/kernels", status_code=201, summary="Start a kernel")
async def start_kernel(workspace_id: str, request: Request, body: StartKernel | None = None,
                       principal: Principal = Depends(current_principal)) -> JSONResponse:
    platform = platform_of(request)
    where = await asyncio.to_thread(_placement, platform, principal, workspace_id)
    name = (body.name if body and body.name else None) or _default_spec(where.specs)
    if name not in where.specs:
        raise InvalidInput(f"unknown kernelspec {name!r}; available: {sorted(where.specs)}")
    kernel_id = str(uuid.uuid4())
    await asyncio.to_thread(_insert_kernel, platform, workspace_id, kernel_id, name)
    try:
        model = await platform.agents.add_kernel(where.host_url, workspace_id, where.generation,
                                                 kernel_id, name)
    except BaseException:
        await asyncio.to_thread(_delete_kernel_row, platform, kernel_id)
        raise
    location = f"/v1/workspaces/{workspace_id}/api/kernels/{kernel_id}"
    return JSONResponse(_jupyter_model(model), status_code=201, headers={"Location": location})


def _insert_kernel(platform: Platform, workspace_id: str, kernel_id: str, name: str) -> None:
    with platform.db.transaction() as session:
        session.add(Kernel(id=kernel_id, workspace_id=workspace_id, name=name,
                           created_at=platform.db.now(session)))


def _delete_kernel_row(platform: Platform, kernel_id: str) -> None:
    with platform.db.transaction() as session:
        row = session.get(Kernel, kernel_id)
        if row is not None:
            session.delete(row)


async def _kernel_placement(platform: Platform, principal: Principal, workspace_id: str,
                            kernel_id: str) -> Placement:
    try:
        where = await asyncio.to_thread(_placement, platform, principal, workspace_id)
    except Conflict as exc:
        raise NotFound(f"kernel {kernel_id} is not running: {exc.detail}") from exc
    if kernel_id not in where.kernel_ids:
        raise NotFound(f"kernel {kernel_id} not found")
    return where


async def _kernel_host(platform: Platform, principal: Principal, workspace_id: str,
                       kernel_id: str) -> str:
    return (await _kernel_placement(platform, principal, workspace_id, kernel_id)).host_url


async def kernel_host(workspace_id: str, kernel_id: str, request: Request,
                      principal: Principal = Depends(current_principal)) -> str:
    """Dependency: the URL of the agent running this caller's kernel (else 404)."""
    return await _kernel_host(platform_of(request), principal, workspace_id, kernel_id)


@router.get("/api/kernels/{kernel_id}", summary="Get a kernel")
async def get_kernel(kernel_id: str, request: Request,
                     host: str = Depends(kernel_host)) -> dict[str, Any]:
    return _jupyter_model(await platform_of(request).agents.kernel(host, kernel_id))


@router.delete("/api/kernels/{kernel_id}", status_code=204, summary="Shut a kernel down")
async def delete_kernel(kernel_id: str, request: Request,
                        host: str = Depends(kernel_host)) -> Response:
    platform = platform_of(request)
    with contextlib.suppress(NotFound):
        await platform.agents.delete_kernel(host, kernel_id)
    await asyncio.to_thread(_delete_kernel_row, platform, kernel_id)
    return Response(status_code=204)


@router.post("/api/kernels/{kernel_id}/interrupt", status_code=204, summary="Interrupt a kernel")
async def interrupt_kernel(kernel_id: str, request: Request,
                           host: str = Depends(kernel_host)) -> Response:
    platform = platform_of(request)
    platform.fleet.gates.interrupt(kernel_id)  # a cell waiting for GPUs is withdrawn
    await platform.agents.interrupt(host, kernel_id)
    return Response(status_code=204)


@router.post("/api/kernels/{kernel_id}/restart", summary="Restart a kernel")
async def restart_kernel(kernel_id: str, request: Request,
                         host: str = Depends(kernel_host)) -> dict[str, Any]:
    return _jupyter_model(await platform_of(request).agents.restart(host, kernel_id))


@router.websocket("/api/kernels/{kernel_id}/channels")
async def kernel_channels(websocket: WebSocket, workspace_id: str, kernel_id: str) -> None:
    platform: Platform = websocket.app.state.platform
    try:
        principal = await asyncio.to_thread(_principal, platform, websocket)
        where = await _kernel_placement(platform, principal, workspace_id, kernel_id)
    except DomainError as exc:
        await deny_websocket(websocket, exc)
        return
    wants_v1 = V1_PROTOCOL in (websocket.scope.get("subprotocols") or [])

    async def connect(where: Location) -> Any:
        # Offer the agent the client's protocol; frames then pass through untouched.
        return await websockets.connect(
            platform.agents.channels_url(where.host_url, kernel_id),
            additional_headers={"Authorization": f"Bearer {platform.config.secret}"},
            subprotocols=[V1_PROTOCOL] if wants_v1 else None,  # type: ignore[list-item]
            max_size=None,
            compression=None,
            open_timeout=10,
        )

    here = Location(where.host_id, where.host_url)
    try:
        upstream = await connect(here)
    except (OSError, websockets.WebSocketException) as exc:
        log.warning("cannot reach kernel %s on %s: %s", kernel_id, where.host_url, exc)
        await websocket.close(code=1011, reason="kernel host unreachable")
        return
    await websocket.accept(subprotocol=upstream.subprotocol)
    if where.gpus == 0:
        await _pump_both_ways(websocket, upstream)
        return

    async def locate() -> Location | Stopped | None:
        try:
            now = await _kernel_placement(platform, principal, workspace_id, kernel_id)
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

    relay = GpuRelay(_sender(websocket), _receiver(websocket), upstream, here, locate, connect,
                     move, changed)
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
            await websocket.close()


def _desired_state(platform: Platform, workspace_id: str) -> str | None:
    with platform.db.transaction(write=False) as session:
        ws = session.get(Workspace, workspace_id)
        return None if ws is None else ws.desired_state


def _receiver(client: WebSocket) -> Callable[[], Awaitable[str | bytes | None]]:
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


def _principal(platform: Platform, websocket: WebSocket) -> Principal:
    with platform.db.transaction(write=False) as session:
        return resolve(session, token_of(websocket.headers, websocket.query_params))


async def _pump_both_ways(client: WebSocket, upstream: Any) -> None:
    async def client_to_upstream() -> None:
        while True:
            event = await client.receive()
            if event["type"] == "websocket.disconnect":
                return
            data = event.get("text")
            await upstream.send(data if data is not None else event.get("bytes") or b"")

    async def upstream_to_client() -> None:
        async for frame in upstream:
            if isinstance(frame, str):
                await client.send_text(frame)
            else:
                await client.send_bytes(frame)

    tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await upstream.close()
        with contextlib.suppress(Exception):
            await client.close()
