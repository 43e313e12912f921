"""Jupyter's Sessions API (``/w/{id}/api/sessions``): which kernel each open
notebook or console talks to. Rows in the DB, so they survive suspend, a restart of
the control plane and any replica answering; a session whose kernel is gone is
dropped, as jupyter_server drops one whose kernel was culled."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, select

from nbfleet.control import workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.control.kernels import kernel_models, launch_kernel, shut_down_kernel
from nbfleet.control.platform import Platform
from nbfleet.db.tables import NotebookSession
from nbfleet.model.errors import InvalidInput, NotFound
from nbfleet.protocol.kernel_env import allowed_kernel_env
from nbfleet.web.bodies import json_model

router = APIRouter(prefix="/w/{workspace_id}/api/sessions")


class KernelChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, max_length=40)
    name: str | None = Field(None, max_length=100)
    env: dict[str, Any] | None = None


class SessionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    path: str | None = Field(None, max_length=1024)
    name: str | None = Field(None, max_length=1024)
    type: str | None = Field(None, max_length=40)
    kernel: KernelChoice | None = None


def _rows(platform: Platform, principal: Principal, workspace_id: str) -> list[NotebookSession]:
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)
        return list(session.execute(
            select(NotebookSession).where(NotebookSession.workspace_id == workspace_id)
            .order_by(NotebookSession.created_at)).scalars())


def _drop(platform: Platform, ids: list[str]) -> None:
    if ids:
        with platform.db.transaction() as session:
            session.execute(delete(NotebookSession).where(NotebookSession.id.in_(ids)))


def _model(row: NotebookSession, kernel: dict[str, Any]) -> dict[str, Any]:
    return {"id": row.id, "path": row.path, "name": row.name, "type": row.type,
            "kernel": kernel, "notebook": {"path": row.path, "name": row.name}}


async def _sessions(platform: Platform, principal: Principal,
                    workspace_id: str) -> list[dict[str, Any]]:
    rows = await asyncio.to_thread(_rows, platform, principal, workspace_id)
    kernels = await kernel_models(platform, principal, workspace_id)
    await asyncio.to_thread(_drop, platform, [r.id for r in rows if r.kernel_id not in kernels])
    return [_model(r, kernels[r.kernel_id]) for r in rows if r.kernel_id in kernels]


async def _one(platform: Platform, principal: Principal, workspace_id: str,
               session_id: str) -> dict[str, Any]:
    for model in await _sessions(platform, principal, workspace_id):
        if model["id"] == session_id:
            return model
    raise NotFound(f"session {session_id} not found")


async def _kernel_for(platform: Platform, principal: Principal, workspace_id: str,
                      choice: KernelChoice | None) -> str:
    """An existing kernel of the workspace's (by id), or a new one (by name)."""
    if choice is not None and choice.id:
        if choice.id not in await kernel_models(platform, principal, workspace_id):
            raise NotFound(f"kernel {choice.id} not found")
        return choice.id
    env = allowed_kernel_env((choice.env if choice else None) or {})
    model = await launch_kernel(platform, principal, workspace_id,
                                choice.name if choice else None, env)
    kernel_id: str = model["id"]
    return kernel_id


@router.get("")
async def list_sessions(workspace_id: str, request: Request,
                        principal: Principal = Depends(current_principal)) -> list[dict[str, Any]]:
    return await _sessions(platform_of(request), principal, workspace_id)


@router.get("/{session_id}")
async def get_session(workspace_id: str, session_id: str, request: Request,
                      principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    return await _one(platform_of(request), principal, workspace_id, session_id)


@router.post("")
async def create_session(workspace_id: str, request: Request,
                         principal: Principal = Depends(current_principal)) -> JSONResponse:
    """A path that has a session already gets that session back (jupyter_server's rule)."""
    platform = platform_of(request)
    body = await json_model(request, SessionBody)
    if not body.path:
        raise InvalidInput("a session needs a path")
    if body.kernel is None or not body.kernel.id:
        for model in await _sessions(platform, principal, workspace_id):
            if model["path"] == body.path:
                return JSONResponse(model, status_code=201)
    kernel_id = await _kernel_for(platform, principal, workspace_id, body.kernel)
    row_id = str(uuid.uuid4())

    def insert() -> None:
        with platform.db.transaction() as session:
            workspaces.get_visible(session, principal, workspace_id)
            session.add(NotebookSession(
                id=row_id, workspace_id=workspace_id, path=body.path or "",
                name=body.name or body.path or "", type=body.type or "notebook",
                kernel_id=kernel_id, created_at=platform.db.now(session)))

    await asyncio.to_thread(insert)
    model = await _one(platform, principal, workspace_id, row_id)
    location = f"{request.url.path.rstrip('/')}/{row_id}"
    return JSONResponse(model, status_code=201, headers={"Location": location})


@router.patch("/{session_id}")
async def update_session(workspace_id: str, session_id: str, request: Request,
                         principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    """Rename (path, name, type) or switch kernel (the old one is shut down, as
    jupyter_server does when the new kernel is a new one)."""
    platform = platform_of(request)
    body = await json_model(request, SessionBody)
    before = await _one(platform, principal, workspace_id, session_id)
    kernel_id = before["kernel"]["id"]
    if (body.kernel is not None and (body.kernel.id or body.kernel.name)
            and body.kernel.id != kernel_id):
        kernel_id = await _kernel_for(platform, principal, workspace_id, body.kernel)

    def update() -> None:
        with platform.db.transaction() as session:
            row = session.get(NotebookSession, session_id)
            if row is None or row.workspace_id != workspace_id:
                raise NotFound(f"session {session_id} not found")
            row.path = body.path or row.path
            row.name = body.name or row.name
            row.type = body.type or row.type
            row.kernel_id = kernel_id

    await asyncio.to_thread(update)
    if kernel_id != before["kernel"]["id"] and not (body.kernel and body.kernel.id):
        await shut_down_kernel(platform, principal, workspace_id, before["kernel"]["id"])
    return await _one(platform, principal, workspace_id, session_id)


@router.delete("/{session_id}", status_code=204)
async def delete_session(workspace_id: str, session_id: str, request: Request,
                         principal: Principal = Depends(current_principal)) -> Response:
    """Ends the session and shuts its kernel down, as jupyter_server does."""
    platform = platform_of(request)
    model = await _one(platform, principal, workspace_id, session_id)
    await shut_down_kernel(platform, principal, workspace_id, model["kernel"]["id"])
    await asyncio.to_thread(_drop, platform, [session_id])
    return Response(status_code=204)
