"""Workspaces in the browser: the list (keyset pages), create, suspend, resume,
delete, a workspace's page with its files, and the JSON the list polls.

Every query is the REST router's, through the same service functions
(``control.workspaces``): the tenant's index (org, project, id) serves the list, a
primary key lookup everything else, so a page costs the same with ten workspaces
or ten thousand.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import quotas, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.dashboard.pages import (
    PAGE_SIZE,
    PageRoute,
    Viewer,
    form_viewer,
    redirect,
    render,
    safe_next,
    viewer,
)
from nbfleet.control.deps import current_principal, platform_of
from nbfleet.control.idempotency import request_fingerprint, run_idempotent
from nbfleet.control.routers.workspaces import CreateWorkspace, fleet_shapes
from nbfleet.db.tables import Project, User, Workspace, WorkspaceEvent
from nbfleet.model.errors import DomainError, InvalidInput, NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.storage.paths import confine
from nbfleet.web.render import iso

router = APIRouter(route_class=PageRoute)
#: JSON for the list's poller: errors stay problem+json, as for any API.
api = APIRouter()

ACTIONS = {"suspend": DesiredState.SUSPENDED, "resume": DesiredState.RUNNING,
           "delete": DesiredState.DELETED}
NOTICES = {"created": "Workspace created: it starts in a moment.",
           "suspend": "Suspend requested: files, packages and variables are saved, then "
                      "the runtime is freed.",
           "resume": "Resume requested: the runtime comes back with the last snapshot.",
           "delete": "Delete requested."}
#: A workspace's page lists at most this many files (the Contents API has them all).
MAX_FILES_SHOWN = 500
_COLUMNS = (Workspace.id, Workspace.name, Workspace.state, Workspace.desired_state,
            Workspace.last_error, Workspace.resources, Workspace.created_at)


def list_page(session: Session, principal: Principal, after: str | None,
              before: str | None) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """One page of the caller's live workspaces, by id: (rows, next ``after``,
    previous ``before``). A range scan of ``ix_workspaces_tenant`` (the primary key
    for an admin, who sees every tenant's)."""
    query = select(*_COLUMNS).where(Workspace.state != WorkspaceState.DELETED)
    if not principal.is_admin:
        query = query.where(Workspace.org_id == principal.org_id,
                            Workspace.project_id == principal.project_id)
    if before:
        query = query.where(Workspace.id < before).order_by(Workspace.id.desc())
    else:
        if after:
            query = query.where(Workspace.id > after)
        query = query.order_by(Workspace.id)
    rows = [dict(row._mapping) for row in session.execute(query.limit(PAGE_SIZE + 1))]
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    if before:
        rows.reverse()
        next_after = rows[-1]["id"] if rows else None
        prev_before = rows[0]["id"] if more and rows else None
    else:
        next_after = rows[-1]["id"] if more else None
        prev_before = rows[0]["id"] if after and rows else None
    for row in rows:
        row["gpus"] = workspaces.spec_from_json(row["resources"])
    return rows, next_after, prev_before


def _with_notice(url: str, done: str) -> str:
    """``url`` with ``done=`` (a notice code) in place of any it had."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "done"]
    return urlunsplit(("", "", parts.path, urlencode([*query, ("done", done)]), ""))


@router.get("/")
def home(request: Request, after: str | None = Query(None, max_length=64),
         before: str | None = Query(None, max_length=64),
         done: str | None = None) -> Response:
    me = viewer(request)
    with platform_of(request).db.transaction(write=False) as session:
        rows, next_after, prev_before = list_page(session, me.principal, after, before)
        quota = quotas.report(session, session.get_one(Project, me.principal.project_id),
                              session.get_one(User, me.principal.user_id))
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    poll = "/ui/api/workspaces" + (f"?after={quote(after)}" if after and not before else
                                   f"?before={quote(before)}" if before else "")
    return render(request, me, "workspaces.html", title="Workspaces", section="workspaces",
                  rows=rows, next_after=next_after, prev_before=prev_before,
                  paged=bool(after or before), here=here, poll=poll, quota=quota,
                  notice=NOTICES.get(done or ""))


@api.get("/ui/api/workspaces", include_in_schema=False)
def poll_states(request: Request, principal: Principal = Depends(current_principal),
                after: str | None = Query(None, max_length=64),
                before: str | None = Query(None, max_length=64)) -> dict[str, Any]:
    """The states of the workspaces on one list page (the page's script polls it)."""
    with platform_of(request).db.transaction(write=False) as session:
        rows, _, _ = list_page(session, principal, after, before)
    return {"items": [{"id": r["id"], "state": r["state"], "desired_state": r["desired_state"],
                       "last_error": r["last_error"]} for r in rows]}


def _new_form(request: Request, me: Viewer, status: int = 200, error: str | None = None,
              values: dict[str, str] | None = None) -> Response:
    with platform_of(request).db.transaction(write=False) as session:
        shapes = fleet_shapes(request).get(session)
    gpu_types = sorted({group.gpu_type for shape in shapes for group in shape.gpus})
    return render(request, me, "workspace_new.html", status, title="New workspace",
                  section="workspaces", error=error, values=values or {}, gpu_types=gpu_types,
                  key=uuid.uuid4().hex)


@router.get("/ui/workspaces/new")
def new_workspace(request: Request) -> Response:
    return _new_form(request, viewer(request))


def _resources(form: dict[str, str]) -> dict[str, Any] | None:
    """The form's GPU request in the API's shape; none given: the project's default."""
    count, kinds = form.get("gpus", "").strip(), form.get("gpu_types", "").strip()
    if not count and not kinds:
        return None
    try:
        gpus = int(count or "0")
    except ValueError:
        raise InvalidInput("GPUs must be a whole number") from None
    return {"gpus": gpus, "gpu_types": [kind.strip() for kind in kinds.split(",")
                                        if kind.strip()]}


def _validation_detail(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                     for err in exc.errors())


@router.post("/ui/workspaces")
async def create_workspace(request: Request) -> Response:
    """The form's hidden ``key`` is an Idempotency-Key: a double submit creates one."""
    me, form = await form_viewer(request)
    try:
        body = CreateWorkspace.model_validate({"name": form.get("name", "").strip(),
                                               "resources": _resources(form)})
    except ValidationError as exc:
        return _new_form(request, me, 422, _validation_detail(exc), form)
    except InvalidInput as exc:
        return _new_form(request, me, 422, exc.detail, form)
    platform = platform_of(request)
    shapes = fleet_shapes(request)
    principal = me.principal

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        spec = workspaces.resolve_resources(
            session, principal, body.resources.spec() if body.resources else None)
        shapes.check(session, spec)
        ws = workspaces.create(session, principal, body.name, platform.db.now(session), spec)
        session.flush()
        return 201, workspaces.to_json(ws)

    fingerprint = request_fingerprint("POST", "/ui/workspaces",
                                      body.model_dump(exclude_none=True))
    try:
        (status, payload), _ = await asyncio.to_thread(
            run_idempotent, platform.db, principal.user_id, form.get("key") or None,
            fingerprint, action)
    except DomainError as exc:
        return _new_form(request, me, exc.status, exc.detail, form)
    if status >= 400:  # a refusal replayed
        return _new_form(request, me, status, str(payload.get("detail", "refused")), form)
    platform.wake()
    return redirect(f"/ui/workspaces/{payload['id']}?done=created")


@router.get("/ui/workspaces/{workspace_id}")
def workspace_page(workspace_id: str, request: Request, done: str | None = None) -> Response:
    me = viewer(request)
    platform = platform_of(request)
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, me.principal, workspace_id)
        body = workspaces.to_json(ws)
        events = list(session.execute(
            select(WorkspaceEvent).where(WorkspaceEvent.workspace_id == ws.id)
            .order_by(WorkspaceEvent.id.desc()).limit(20)).scalars())
    files = [] if ws.state == WorkspaceState.DELETED else platform.files.list(ws.id)
    more_files = max(0, len(files) - MAX_FILES_SHOWN)
    return render(request, me, "workspace.html", title=f"Workspace {ws.name}",
                  section="workspaces", ws=body,
                  events=[{"from": e.from_state, "to": e.to_state, "reason": e.reason,
                           "at": iso(e.created_at)} for e in events],
                  files=files[:MAX_FILES_SHOWN], more_files=more_files,
                  notice=NOTICES.get(done or ""))


@router.get("/ui/workspaces/{workspace_id}/files/{path:path}")
def download_file(workspace_id: str, path: str, request: Request) -> Response:
    """Always a download (``attachment``, ``application/octet-stream``, no sniffing):
    a user's HTML file must never run as a page of this origin."""
    me = viewer(request)
    platform = platform_of(request)
    clean = confine(path)
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, me.principal, workspace_id)
    data = platform.files.get(workspace_id, clean)
    filename = clean.rsplit("/", 1)[-1]
    return Response(data, media_type="application/octet-stream", headers={
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(filename, safe='')}",
        "Content-Security-Policy": "sandbox; default-src 'none'"})


@router.post("/ui/workspaces/{workspace_id}/{action}")
async def change_state(workspace_id: str, action: str, request: Request) -> Response:
    me, form = await form_viewer(request)
    desired = ACTIONS.get(action)
    if desired is None:
        raise NotFound(f"no action {action!r}")
    platform = platform_of(request)

    def run() -> None:
        with platform.db.transaction() as session:
            ws = workspaces.get_visible(session, me.principal, workspace_id, for_update=True)
            workspaces.request_state(ws, desired, platform.db.now(session))

    await asyncio.to_thread(run)
    platform.wake()
    default = "/" if desired is DesiredState.DELETED else f"/ui/workspaces/{workspace_id}"
    back = safe_next(form.get("back") or default)
    return redirect(_with_notice(back, action))
