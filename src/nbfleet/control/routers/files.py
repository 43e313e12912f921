"""``/v1/workspaces/{id}/files``: the blob store is the truth; a live runtime gets a copy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from nbfleet.control import hosts, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.control.platform import Platform
from nbfleet.model.errors import Conflict, DomainError
from nbfleet.model.workspace import WorkspaceState
from nbfleet.storage.paths import confine
from nbfleet.storage.uploads import Upload
from nbfleet.web.bodies import spool
from nbfleet.web.render import iso

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/workspaces/{workspace_id}/files", tags=["files"])

_GONE = (WorkspaceState.DELETING, WorkspaceState.DELETED)


def _live_host(platform: Platform, principal: Principal, workspace_id: str,
               writing: bool) -> str | None:
    """Check access; return the URL of the host running the workspace, if any."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        if writing and ws.state in _GONE:
            raise Conflict(f"workspace is {ws.state}", current_state=ws.state)
        if ws.state != WorkspaceState.RUNNING:
            return None
        now = platform.db.now(session)
        agent = hosts.alive_agent(session, ws.host_id, now, platform.config.agent_timeout_s)
        return agent.url if agent is not None and agent.boot_id == ws.host_boot_id else None


@router.get("", summary="List the workspace's files")
async def list_files(workspace_id: str, request: Request,
                     principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    platform = platform_of(request)
    await asyncio.to_thread(_live_host, platform, principal, workspace_id, False)
    blobs = await asyncio.to_thread(platform.files.list, workspace_id)
    return {
        "files": [
            {"path": b.key, "size": b.size, "modified": iso(b.modified)} for b in blobs
        ]
    }


@router.get("/{path:path}", summary="Read a file")
async def get_file(workspace_id: str, path: str, request: Request,
                   principal: Principal = Depends(current_principal)) -> Response:
    platform = platform_of(request)
    await asyncio.to_thread(_live_host, platform, principal, workspace_id, False)
    data = await asyncio.to_thread(platform.files.get, workspace_id, path)
    media = "application/x-ipynb+json" if path.endswith(".ipynb") else "application/octet-stream"
    return Response(data, media_type=media)


#: The body is any bytes, none at all for an empty file; saying so lets the docs
#: and API fuzzers send one.
_RAW_BODY = {"requestBody": {"required": False, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.put("/{path:path}", summary="Write a file (atomic; notebooks are validated)",
            openapi_extra=_RAW_BODY)
async def put_file(workspace_id: str, path: str, request: Request,
                   principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    """The body streams to a temporary file as it arrives (413 once it passes the
    file size limit), then replaces the file atomically; a running workspace gets a
    copy streamed from that file. Memory per request stays bounded."""
    platform = platform_of(request)
    clean = confine(path)
    host = await asyncio.to_thread(_live_host, platform, principal, workspace_id, True)
    upload = await asyncio.to_thread(platform.files.upload, workspace_id, clean)
    try:
        size = await spool(request.stream(), upload.write, upload.limit, clean)
        await asyncio.to_thread(platform.files.commit, workspace_id, clean, upload)
        if host is not None:
            try:
                await platform.agents.put_file(host, workspace_id, clean, _read_back(upload),
                                               size)
            except DomainError as exc:  # saved already; the runtime catches up on resume
                log.warning("could not mirror %s into the runtime: %s", clean, exc.detail)
    finally:
        await asyncio.to_thread(upload.close)
    return {"path": clean, "size": size}


async def _read_back(upload: Upload) -> AsyncIterator[bytes]:
    offset = 0
    while chunk := await asyncio.to_thread(upload.read_chunk, offset):
        offset += len(chunk)
        yield chunk


@router.delete("/{path:path}", status_code=204, summary="Delete a file")
async def delete_file(workspace_id: str, path: str, request: Request,
                      principal: Principal = Depends(current_principal)) -> Response:
    platform = platform_of(request)
    clean = confine(path)
    host = await asyncio.to_thread(_live_host, platform, principal, workspace_id, True)
    await asyncio.to_thread(platform.files.delete, workspace_id, clean)
    if host is not None:
        try:
            await platform.agents.delete_file(host, workspace_id, clean)
        except DomainError as exc:
            log.warning("could not mirror the deletion of %s: %s", clean, exc.detail)
    return Response(status_code=204)
