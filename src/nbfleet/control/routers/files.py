"""``/v1/workspaces/{id}/files``: the blob store is the truth; a live runtime gets a copy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.control.file_mirror import live_host
from nbfleet.model.errors import DomainError
from nbfleet.storage.paths import confine
from nbfleet.storage.uploads import Upload
from nbfleet.web.bodies import spool
from nbfleet.web.render import iso

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/workspaces/{workspace_id}/files", tags=["files"])

@router.get("", summary="List the workspace's files")
async def list_files(workspace_id: str, request: Request,
                     principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    platform = platform_of(request)
    await asyncio.to_thread(live_host, platform, principal, workspace_id, False)
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
    await asyncio.to_thread(live_host, platform, principal, workspace_id, False)
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
    host = await asyncio.to_thread(live_host, platform, principal, workspace_id, True)
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
    host = await asyncio.to_thread(live_host, platform, principal, workspace_id, True)
    await asyncio.to_thread(platform.files.delete, workspace_id, clean)
    if host is not None:
        try:
            await platform.agents.delete_file(host, workspace_id, clean)
        except DomainError as exc:
            log.warning("could not mirror the deletion of %s: %s", clean, exc.detail)
    return Response(status_code=204)
