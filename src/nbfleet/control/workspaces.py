"""Workspace rows: tenant-scoped lookup, desired-state requests and audited transitions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control.auth import Principal
from nbfleet.db.ids import new_id
from nbfleet.db.tables import Workspace, WorkspaceEvent
from nbfleet.model.errors import NotFound
from nbfleet.model.workspace import (
    DesiredState,
    WorkspaceState,
    check_request,
    check_transition,
    is_settled,
)
from nbfleet.web.metrics import WORKSPACE_TRANSITIONS
from nbfleet.web.render import iso


def to_json(ws: Workspace) -> dict[str, Any]:
    return {
        "id": ws.id,
        "name": ws.name,
        "state": ws.state,
        "desired_state": ws.desired_state,
        "generation": ws.generation,
        "host_id": ws.host_id,
        "last_error": ws.last_error,
        "snapshot": _snapshot_summary(ws.snapshot),
        "restore": ws.restore,
        "created_at": iso(ws.created_at),
        "updated_at": iso(ws.updated_at),
    }


def _snapshot_summary(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a user may know of the last snapshot: when, how big, what it holds."""
    if not snapshot:
        return None
    return {"at": snapshot.get("at"), "bytes": snapshot.get("bytes", 0),
            "kernels": sorted(snapshot.get("kernels", {})),
            "packages": snapshot.get("packages") is not None,
            "notes": snapshot.get("notes", [])}


def is_done(ws: Workspace) -> bool:
    """True once a requested change has run its course. ``failed`` is not the end of
    one: the reconciler retries a failed placement (with backoff) until it succeeds
    or another state is requested, so a wait goes on and, if time runs out, answers
    202 with the last error rather than a final-looking failure."""
    state = WorkspaceState(ws.state)
    return is_settled(state, DesiredState(ws.desired_state)) or state is WorkspaceState.DELETED


def for_request(body: dict[str, Any], generation: int) -> dict[str, Any]:
    """``body`` answering the request that produced ``generation``: a restore summary
    recorded for another generation (an earlier resume) is left out."""
    restore = body.get("restore")
    if isinstance(restore, dict) and restore.get("generation") != generation:
        return {**body, "restore": None}
    return body


def get_visible(session: Session, principal: Principal, workspace_id: str,
                for_update: bool = False) -> Workspace:
    """The workspace if this principal may see it; 404 otherwise (no existence leak)."""
    query = select(Workspace).where(Workspace.id == workspace_id)
    if for_update:
        query = query.with_for_update()
    ws = session.execute(query).scalar_one_or_none()
    if ws is None or not principal.can_see(ws.org_id, ws.project_id):
        raise NotFound(f"workspace {workspace_id} not found")
    return ws


def create(session: Session, principal: Principal, name: str, now: datetime) -> Workspace:
    ws = Workspace(
        id=new_id("ws"),
        org_id=principal.org_id,
        project_id=principal.project_id,
        owner_id=principal.user_id,
        name=name,
        state=WorkspaceState.CREATING,
        desired_state=DesiredState.RUNNING,
        generation=1,
        pending=True,
        attempts=0,
        created_at=now,
        updated_at=now,
    )
    session.add(ws)
    session.add(WorkspaceEvent(workspace_id=ws.id, from_state=None, to_state=ws.state,
                               reason="created", created_at=now))
    return ws


def request_state(ws: Workspace, desired: DesiredState, now: datetime) -> None:
    """Record a new desired state; a repeat of the current one changes nothing."""
    check_request(WorkspaceState(ws.state), desired, DesiredState(ws.desired_state))
    if ws.desired_state == desired:
        return
    ws.desired_state = desired
    ws.generation += 1
    ws.pending = True
    ws.attempts = 0
    ws.next_attempt_at = None
    ws.updated_at = now


def transition(session: Session, ws: Workspace, new: WorkspaceState, now: datetime,
               reason: str | None = None) -> None:
    old = WorkspaceState(ws.state)
    check_transition(old, new)
    ws.state = new
    ws.updated_at = now
    ws.pending = not is_settled(new, DesiredState(ws.desired_state))
    session.add(WorkspaceEvent(workspace_id=ws.id, from_state=old, to_state=new, reason=reason,
                               created_at=now))
    WORKSPACE_TRANSITIONS.labels(str(old), str(new)).inc()
