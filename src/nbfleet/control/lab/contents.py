"""Jupyter's Contents API for JupyterLab (``/w/{id}/api/contents``): the
workspace's durable files (``storage.contents``), mirrored into a live runtime."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.control.file_mirror import live_host, mirror
from nbfleet.control.platform import Platform
from nbfleet.model.errors import InvalidInput
from nbfleet.storage.contents import Change, WorkspaceContents
from nbfleet.web.bodies import json_object

router = APIRouter(prefix="/w/{workspace_id}/api/contents")


def _contents(platform: Platform) -> WorkspaceContents:
    return WorkspaceContents(platform.files)


def _flag(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    if value not in ("0", "1"):
        raise InvalidInput("content and hash must be 0 or 1")
    return value == "1"


async def _write(request: Request, principal: Principal, workspace_id: str,
                 work: Any) -> Any:
    """Run a change on the store, then mirror it into the live runtime."""
    platform = platform_of(request)
    host = await asyncio.to_thread(live_host, platform, principal, workspace_id, True)
    result, changes = await asyncio.to_thread(work, _contents(platform))
    await mirror(platform, host, workspace_id, changes)
    return result


def _location(request: Request, path: str) -> dict[str, str]:
    base = request.url.path.split("/api/contents", 1)[0]
    return {"Location": f"{base}/api/contents/{path}"}


@router.get("")
@router.get("/{path:path}")
async def get_contents(workspace_id: str, request: Request, path: str = "",
                       type: str | None = None, format: str | None = None,
                       content: str | None = None,
                       principal: Principal = Depends(current_principal)) -> Any:
    """A model, or (on ``FILE/checkpoints``) the file's checkpoints."""
    platform = platform_of(request)
    await asyncio.to_thread(live_host, platform, principal, workspace_id, False)
    if path.endswith("/checkpoints"):
        return await _list_checkpoints(platform, workspace_id, path)
    if type not in (None, "file", "notebook", "directory"):
        raise InvalidInput(f"unknown type {type!r}")
    if format not in (None, "text", "base64", "json"):
        raise InvalidInput(f"unknown format {format!r}")
    return await asyncio.to_thread(_contents(platform).get, workspace_id, path,
                                   _flag(content, True), type, format)


async def _list_checkpoints(platform: Platform, workspace_id: str,
                            path: str) -> list[dict[str, Any]]:
    file_path = path[: -len("/checkpoints")]
    return await asyncio.to_thread(_contents(platform).checkpoints, workspace_id, file_path)


@router.put("/{path:path}")
async def save(workspace_id: str, path: str, request: Request,
               principal: Principal = Depends(current_principal)) -> JSONResponse:
    body = await json_object(request)
    if "copy_from" in body:
        raise InvalidInput("copy with POST to the target directory, not PUT")

    def work(contents: WorkspaceContents) -> tuple[tuple[dict[str, Any], bool], list[Change]]:
        model, created, changes = contents.save(workspace_id, path, body)
        return (model, created), changes

    model, created = await _write(request, principal, workspace_id, work)
    return JSONResponse(model, status_code=201 if created else 200,
                        headers=_location(request, model["path"]))


@router.post("")
@router.post("/{path:path}")
async def create(workspace_id: str, request: Request, path: str = "",
                 principal: Principal = Depends(current_principal)) -> JSONResponse:
    """A new untitled file, or a copy (``copy_from``), in directory ``path``; or,
    on ``FILE/checkpoints``, a checkpoint."""
    if path.endswith("/checkpoints"):
        file_path = path[: -len("/checkpoints")]
        platform = platform_of(request)
        await asyncio.to_thread(live_host, platform, principal, workspace_id, True)
        checkpoint = await asyncio.to_thread(_contents(platform).create_checkpoint,
                                             workspace_id, file_path)
        return JSONResponse(checkpoint, status_code=201)
    if "/checkpoints/" in path:
        file_path, checkpoint_id = path.rsplit("/checkpoints/", 1)
        await _write(request, principal, workspace_id, lambda contents: (None, (
            contents.restore_checkpoint(workspace_id, file_path, checkpoint_id))))
        return JSONResponse(None, status_code=204)
    body = await json_object(request)
    copy_from = body.get("copy_from")
    kind, ext = body.get("type") or "", body.get("ext") or ""
    if not isinstance(kind, str) or not isinstance(ext, str):
        raise InvalidInput("type and ext must be strings")
    if copy_from is not None and not isinstance(copy_from, str):
        raise InvalidInput("copy_from must be a path")

    def work(contents: WorkspaceContents) -> tuple[dict[str, Any], list[Change]]:
        if copy_from is not None:
            return contents.copy(workspace_id, copy_from, path)
        return contents.new_untitled(workspace_id, path, kind, ext)

    model = await _write(request, principal, workspace_id, work)
    return JSONResponse(model, status_code=201, headers=_location(request, model["path"]))


@router.patch("/{path:path}")
async def rename(workspace_id: str, path: str, request: Request,
                 principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    body = await json_object(request)
    new = body.get("path")
    if not isinstance(new, str):
        raise InvalidInput("a rename needs the new 'path'")
    model: dict[str, Any] = await _write(
        request, principal, workspace_id,
        lambda contents: contents.rename(workspace_id, path, new))
    return model


@router.delete("/{path:path}", status_code=204)
async def delete(workspace_id: str, path: str, request: Request,
                 principal: Principal = Depends(current_principal)) -> Response:
    if "/checkpoints/" in path:
        file_path, checkpoint_id = path.rsplit("/checkpoints/", 1)
        platform = platform_of(request)
        await asyncio.to_thread(live_host, platform, principal, workspace_id, True)
        await asyncio.to_thread(_contents(platform).delete_checkpoint, workspace_id,
                                file_path, checkpoint_id)
        return Response(status_code=204)
    await _write(request, principal, workspace_id,
                 lambda contents: (None, contents.delete(workspace_id, path)))
    return Response(status_code=204)
