"""The Jupyter Kernel Gateway API, scoped to one workspace.

A workspace's gateway URL is ``{base}/v1/workspaces/{id}``; point
``jupyter server --gateway-url`` (or JupyterLab, VS Code, nbclient) at it. The same
routes serve nbfleet's own JupyterLab under ``/w/{id}``. Frames on
``/api/kernels/{id}/channels`` are relayed verbatim to the agent that runs the kernel.

A kernel keeps its id while its workspace is suspended (``resting_kernels``): it is
listed, answers its id, and a request on its channels resumes the workspace
(``kernel_channels``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from nbfleet.control import channel_tickets, kernels, workspaces
from nbfleet.control import kernel_channels as kernel_channels_ws
from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.model.errors import NotFound
from nbfleet.protocol.kernel_env import allowed_kernel_env
from nbfleet.web.bodies import json_model
from nbfleet.web.render import iso

#: The Kernel Gateway routes, mounted under ``/v1/workspaces/{id}`` (documented) and
#: under ``/w/{id}`` for JupyterLab.
routes = APIRouter()

class StartKernel(BaseModel):
    """Jupyter's kernel start request, read whatever its Content-Type (as jupyter_server
    and Kernel Gateway do). Kernel Gateway clients also send ``env``, of which only
    ``KERNEL_*`` variables pass (``allowed_kernel_env``)."""

    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    env: dict[str, Any] | None = None


@routes.get("/api/kernelspecs", summary="List kernelspecs")
async def list_kernelspecs(workspace_id: str, request: Request,
                           principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    specs = await asyncio.to_thread(kernels.any_specs, platform_of(request), principal,
                                    workspace_id)
    return {"default": kernels.default_spec(specs), "kernelspecs": specs}


@routes.get("/api/kernelspecs/{name}", summary="Get a kernelspec")
async def get_kernelspec(workspace_id: str, name: str, request: Request,
                         principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    specs = await asyncio.to_thread(kernels.any_specs, platform_of(request), principal,
                                    workspace_id)
    if name not in specs:
        raise NotFound(f"no kernelspec {name!r}")
    spec: dict[str, Any] = specs[name]
    return spec


@routes.get("/kernelspecs/{name}/{path:path}", summary="Kernelspec resources (none served)")
async def kernelspec_resource(workspace_id: str, name: str, path: str,
                              principal: Principal = Depends(current_principal)) -> Response:
    raise NotFound(f"kernelspec {name} has no resource {path}")


@routes.get("/api/kernels", summary="List the workspace's kernels")
async def list_kernels(workspace_id: str, request: Request,
                       principal: Principal = Depends(current_principal)) -> list[dict[str, Any]]:
    """A suspended workspace's kernels are listed too, as ``suspended``."""
    models = await kernels.kernel_models(platform_of(request), principal, workspace_id)
    return list(models.values())


_START_BODY = {"requestBody": {"required": False, "content": {
    "application/json": {"schema": StartKernel.model_json_schema()}}}}


@routes.post("/api/kernels", status_code=201, summary="Start a kernel",
             openapi_extra=_START_BODY)
async def start_kernel(workspace_id: str, request: Request,
                       principal: Principal = Depends(current_principal)) -> JSONResponse:
    """Starting a kernel in a suspended workspace resumes it first."""
    body = await json_model(request, StartKernel)
    model = await kernels.launch_kernel(platform_of(request), principal, workspace_id, body.name,
                                allowed_kernel_env(body.env or {}))
    location = f"{request.url.path.rstrip('/')}/{model['id']}"
    return JSONResponse(model, status_code=201, headers={"Location": location})


@routes.get("/api/kernels/{kernel_id}", summary="Get a kernel")
async def get_kernel(workspace_id: str, kernel_id: str, request: Request,
                     principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    """A suspended workspace's kernel answers too, as ``suspended``."""
    platform = platform_of(request)
    where = await kernels.running_or_resting(platform, principal, workspace_id, kernel_id)
    if isinstance(where, dict):
        return where
    return kernels.jupyter_model(await platform.agents.kernel(where.host_url, kernel_id))


@routes.delete("/api/kernels/{kernel_id}", status_code=204, summary="Shut a kernel down")
async def delete_kernel(workspace_id: str, kernel_id: str, request: Request,
                        principal: Principal = Depends(current_principal)) -> Response:
    """A suspended kernel is forgotten: the next resume does not bring it back."""
    await kernels.shut_down_kernel(platform_of(request), principal, workspace_id, kernel_id)
    return Response(status_code=204)


@routes.post("/api/kernels/{kernel_id}/interrupt", status_code=204, summary="Interrupt a kernel")
async def interrupt_kernel(workspace_id: str, kernel_id: str, request: Request,
                           principal: Principal = Depends(current_principal)) -> Response:
    """A suspended kernel runs nothing: there is nothing to interrupt."""
    platform = platform_of(request)
    where = await kernels.running_or_resting(platform, principal, workspace_id, kernel_id)
    platform.fleet.gates.interrupt(kernel_id)  # a cell waiting for GPUs is withdrawn
    if not isinstance(where, dict):
        await platform.agents.interrupt(where.host_url, kernel_id)
    return Response(status_code=204)


@routes.post("/api/kernels/{kernel_id}/restart", summary="Restart a kernel")
async def restart_kernel(workspace_id: str, kernel_id: str, request: Request,
                         principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    """Restarting a suspended kernel resumes its workspace, then restarts it."""
    platform = platform_of(request)
    where = await kernels.kernel_placement(platform, principal, workspace_id, kernel_id, wake=True)
    return kernels.jupyter_model(await platform.agents.restart(where.host_url, kernel_id))


@routes.websocket("/api/kernels/{kernel_id}/channels")
async def kernel_channels(websocket: WebSocket, workspace_id: str, kernel_id: str) -> None:
    await kernel_channels_ws.serve(websocket, workspace_id, kernel_id)


#: The documented Kernel Gateway API of a workspace.
router = APIRouter(prefix="/v1/workspaces/{workspace_id}", tags=["kernel gateway"])
router.include_router(routes)


class ChannelTicket(BaseModel):
    ticket: str
    expires_at: str
    #: ``JUPYTER_GATEWAY_WS_URL`` for a gateway URL of ``/v1/workspaces/{id}``.
    ws_url: str
    #: The same for nbfleet's Lab server (``/w/{id}``).
    lab_ws_url: str


@router.post("/channel-tickets", status_code=201, response_model=ChannelTicket,
             summary="A ticket for kernel WebSockets of clients that send no credentials")
def new_channel_ticket(workspace_id: str, request: Request,
                       principal: Principal = Depends(current_principal)) -> ChannelTicket:
    """jupyter_server's gateway kernel client (nbclient, papermill) opens kernel
    WebSockets without credentials: set ``JUPYTER_GATEWAY_WS_URL`` to ``ws_url``.
    The ticket opens this workspace's kernel channels only, for 12 hours."""
    platform = platform_of(request)
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)
        now = platform.db.now(session)
    ticket, expires = channel_tickets.issue(platform.config.secret, principal.user_id,
                                            workspace_id, now)
    scheme = "wss" if request.url.scheme == "https" else "ws"
    base = f"{scheme}://{request.url.netloc}/t/{ticket}"
    return ChannelTicket(ticket=ticket, expires_at=iso(expires) or "",
                         ws_url=f"{base}/v1/workspaces/{workspace_id}",
                         lab_ws_url=f"{base}/w/{workspace_id}")


#: Kernel channels authenticated by a ticket in the path (``channel_tickets``).
ticketed = APIRouter(include_in_schema=False)


@ticketed.websocket("/t/{ticket}/v1/workspaces/{workspace_id}/api/kernels/{kernel_id}/channels")
@ticketed.websocket("/t/{ticket}/w/{workspace_id}/api/kernels/{kernel_id}/channels")
async def ticketed_channels(websocket: WebSocket, ticket: str, workspace_id: str,
                            kernel_id: str) -> None:
    await kernel_channels_ws.serve(websocket, workspace_id, kernel_id, ticket=ticket)
