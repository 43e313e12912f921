"""jupyter_server's event bus, as far as Lab needs it: Lab subscribes at start and
may post events. nbfleet emits no server events to it (yet), so the socket stays
quiet, and posted events are accepted and dropped."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Response, WebSocket

from nbfleet.control import workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import principal_of_websocket
from nbfleet.control.lab.settings import visible
from nbfleet.control.platform import Platform
from nbfleet.model.errors import DomainError
from nbfleet.web.problems import deny_websocket

router = APIRouter(prefix="/w/{workspace_id}/api/events")


def _check(platform: Platform, websocket: WebSocket, workspace_id: str) -> None:
    principal = principal_of_websocket(platform, websocket)
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)


@router.websocket("/subscribe")
async def subscribe(websocket: WebSocket, workspace_id: str) -> None:
    platform: Platform = websocket.app.state.platform
    try:
        await asyncio.to_thread(_check, platform, websocket, workspace_id)
    except DomainError as exc:
        await deny_websocket(websocket, exc)
        return
    await websocket.accept()
    while (await websocket.receive())["type"] != "websocket.disconnect":
        pass


@router.post("", status_code=204)
def post_event(principal: Principal = Depends(visible)) -> Response:
    return Response(status_code=204)
