"""``/v1/workspaces``: create, read, list, suspend, resume, delete, events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import quotas, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, idempotent_reply, platform_of
from nbfleet.db.tables import Project, User, Workspace, WorkspaceEvent
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.web.render import iso

router = APIRouter(prefix="/v1/workspaces", tags=["workspaces"])


class CreateWorkspace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    resources: workspaces.ResourceRequest | None = Field(
        None, description="What the workspace asks for; left out: the project's default "
                          "(no default: no GPUs). Stored as resolved at creation.")


def fleet_shapes(request: Request) -> workspaces.FleetShapes:
    """This process's cache of the fleet's host shapes (made on first use)."""
    state = request.app.state
    shapes: workspaces.FleetShapes | None = getattr(state, "workspace_shapes", None)
    if shapes is None:
        config = platform_of(request).config
        shapes = state.workspace_shapes = workspaces.FleetShapes(
            config.fleet.host_gpus, config.fleet.max_hosts)
    return shapes


#: The workspace bodies the routes answer with, for the OpenAPI schema only: the
#: bodies are built by ``workspaces.to_json`` and not validated on the way out.
_WORKSPACE: dict[str, Any] = {"model": workspaces.WorkspaceBody, "description": "The workspace"}
_SETTLED: dict[int | str, dict[str, Any]] = {
    200: {**_WORKSPACE, "description": "The workspace, settled (with ``wait``)"},
    202: {**_WORKSPACE, "description": "The workspace, the change under way"}}


@router.post("", status_code=201, summary="Create a workspace",
             responses={201: _WORKSPACE})
def create_workspace(body: CreateWorkspace, request: Request,
                     principal: Principal = Depends(current_principal)) -> JSONResponse:
    """A resource request no host shape (registered, or the autoscaler's) can ever
    satisfy is refused with 422 saying what is missing."""
    db = platform_of(request).db
    shapes = fleet_shapes(request)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        spec = workspaces.resolve_resources(
            session, principal, body.resources.spec() if body.resources else None)
        shapes.check(session, spec)
        ws = workspaces.create(session, principal, body.name, db.now(session), spec)
        session.flush()
        return 201, workspaces.to_json(ws)

    # Without ``resources`` the request hashes as it did before requests existed.
    return idempotent_reply(request, principal, body.model_dump(exclude_none=True), action)


@router.get("", summary="List workspaces", response_model=None,
            responses={200: {"model": workspaces.WorkspacePage, "description": "A page"}})
def list_workspaces(
    request: Request,
    principal: Principal = Depends(current_principal),
    limit: int = Query(50, ge=1, le=500),
    after: str | None = Query(None, description="cursor: the last id of the previous page"),
    state: WorkspaceState | None = None,
) -> dict[str, Any]:
    query = select(Workspace).order_by(Workspace.id).limit(limit + 1)
    if not principal.is_admin:
        query = query.where(Workspace.org_id == principal.org_id,
                            Workspace.project_id == principal.project_id)
    if after:
        query = query.where(Workspace.id > after)
    if state is not None:
        query = query.where(Workspace.state == state)
    else:
        query = query.where(Workspace.state != WorkspaceState.DELETED)
    with platform_of(request).db.transaction(write=False) as session:
        rows = list(session.execute(query).scalars())
    page = rows[:limit]
    return {
        "items": [workspaces.to_json(ws) for ws in page],
        "next": page[-1].id if len(rows) > limit else None,
    }


@router.get("/quota", summary="Your workspace quota and what you and your project hold")
def my_quota(request: Request,
             principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    """``user``: your limits and usage; ``project``: your project's totals (null
    limits are unlimited). Over a limit, creates and resumes answer 403
    ``quota-exceeded`` naming it."""
    with platform_of(request).db.transaction(write=False) as session:
        project = session.get_one(Project, principal.project_id)
        user = session.get_one(User, principal.user_id)
        return quotas.report(session, project, user)


@router.get("/{workspace_id}", summary="Get a workspace", response_model=None,
            responses={200: _WORKSPACE})
def get_workspace(workspace_id: str, request: Request,
                  principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        return workspaces.to_json(workspaces.get_visible(session, principal, workspace_id))


@router.get("/{workspace_id}/events", summary="A workspace's state changes")
def workspace_events(workspace_id: str, request: Request,
                     principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)
        events = session.execute(
            select(WorkspaceEvent)
            .where(WorkspaceEvent.workspace_id == workspace_id)
            .order_by(WorkspaceEvent.id)
        ).scalars()
        return {
            "items": [
                {"from": e.from_state, "to": e.to_state, "reason": e.reason,
                 "at": iso(e.created_at)}
                for e in events
            ]
        }


WAIT = Query(0.0, ge=0, le=300, description=(
    "Seconds to wait for the change to finish. 0 answers 202 at once; otherwise the "
    "answer is 200 with the settled workspace (and, for a resume, what this resume "
    "restored), or 202 if it is still in progress when the time is up: `failed` is not "
    "final, a failed placement is retried and `last_error` says why it failed."))


def resume_answer(body: dict[str, Any], generation: int, found_running: bool) -> dict[str, Any]:
    """``body`` answering a resume that produced ``generation``, with the restore
    summary of that resume only. One that found the workspace already running
    restored nothing: it left the generation as it was (or only cancelled a suspend
    not yet begun), so the summary on record, of the resume that started the runtime,
    would otherwise pass for its own."""
    if found_running:
        return {**body, "restore": None}
    return workspaces.for_request(body, generation)


async def _request_state(request: Request, principal: Principal, workspace_id: str,
                         desired: DesiredState, wait: float = 0.0) -> JSONResponse:
    platform = platform_of(request)
    db = platform.db
    resuming = desired is DesiredState.RUNNING

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        ws = workspaces.get_visible(session, principal, workspace_id, for_update=True)
        workspaces.request_state(ws, desired, db.now(session))
        body = workspaces.to_json(ws)
        if not resuming:
            return 202, body
        return 202, resume_answer(body, ws.generation, ws.state == WorkspaceState.RUNNING)

    response = await asyncio.to_thread(
        idempotent_reply, request, principal, {"desired": str(desired)}, action)
    if wait <= 0 or response.status_code >= 400:
        return response
    # The restore summary shown must be this request's (its generation), never an
    # earlier resume's that is still recorded while this one runs. The first answer
    # (stored, so a replay reads the same) says both what it was and where it started.
    first = json.loads(bytes(response.body))
    generation = int(first["generation"])
    found_running = first["state"] == WorkspaceState.RUNNING

    def read() -> tuple[bool, dict[str, Any]]:
        with db.transaction(write=False) as session:
            ws = workspaces.get_visible(session, principal, workspace_id)
            body = workspaces.to_json(ws)
            return workspaces.is_done(ws), (resume_answer(body, generation, found_running)
                                            if resuming else body)

    done, body = await platform.until(first["id"], read, wait)
    return JSONResponse(body, status_code=200 if done else 202)


@router.post("/{workspace_id}/suspend", status_code=202, summary="Suspend a workspace",
             responses=_SETTLED)
async def suspend_workspace(workspace_id: str, request: Request, wait: float = WAIT,
                            principal: Principal = Depends(current_principal)) -> JSONResponse:
    """Save files, packages and variables, then release the runtime (see ``wait``)."""
    return await _request_state(request, principal, workspace_id, DesiredState.SUSPENDED, wait)


@router.post("/{workspace_id}/resume", status_code=202, summary="Resume a workspace",
             responses=_SETTLED)
async def resume_workspace(workspace_id: str, request: Request, wait: float = WAIT,
                           principal: Principal = Depends(current_principal)) -> JSONResponse:
    """Bring the runtime back with the last snapshot; ``restore`` says what came back."""
    return await _request_state(request, principal, workspace_id, DesiredState.RUNNING, wait)


@router.delete("/{workspace_id}", status_code=202, summary="Delete a workspace",
               responses={202: _WORKSPACE})
async def delete_workspace(workspace_id: str, request: Request,
                           principal: Principal = Depends(current_principal)) -> JSONResponse:
    return await _request_state(request, principal, workspace_id, DesiredState.DELETED)
