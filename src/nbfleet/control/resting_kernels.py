"""Kernels keep their identity while their workspace is not running.

A suspended workspace's kernels are rows, not processes; Jupyter clients still list
them and ask for them by id. jupyter_server's gateway client forgets a kernel for
good the moment its id answers 404 ("possibly culled"), and its next cell then starts
an empty kernel, so these answer with a model whose state says ``suspended``. A
client that connects to such a kernel wakes the workspace and waits for it.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.platform import Platform
from nbfleet.db.tables import Kernel, Workspace
from nbfleet.model.errors import Conflict, NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState

#: How long a connection to a resting kernel waits for its workspace to come back.
WAKE_TIMEOUT_S = 120.0

_STARTING = frozenset({WorkspaceState.CREATING, WorkspaceState.RESUMING})


def jupyter_time(moment: datetime) -> str:
    """Jupyter's model timestamp (``%Y-%m-%dT%H:%M:%S.%fZ``: the gateway client
    parses exactly this)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def resting_state(ws: Workspace) -> str:
    """The ``execution_state`` a resting kernel reports: ``starting`` while its
    workspace comes (back) up, else ``suspended``."""
    return "starting" if WorkspaceState(ws.state) in _STARTING else "suspended"


def resting_models(platform: Platform, principal: Principal,
                   workspace_id: str) -> list[dict[str, Any]]:
    """The workspace's kernels as Jupyter models, when it has no live runtime."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        return [_model(row, ws) for row in _rows(session, ws.id)]


def resting_model(platform: Platform, principal: Principal, workspace_id: str,
                  kernel_id: str) -> dict[str, Any]:
    """One kernel's model while its workspace is not running; 404 if it has no such
    kernel."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        row = session.get(Kernel, kernel_id)
        if row is None or row.workspace_id != ws.id:
            raise NotFound(f"kernel {kernel_id} not found")
        return _model(row, ws)


def _rows(session: Session, workspace_id: str) -> list[Kernel]:
    return list(session.execute(
        select(Kernel).where(Kernel.workspace_id == workspace_id).order_by(Kernel.created_at)
    ).scalars())


def _model(row: Kernel, ws: Workspace) -> dict[str, Any]:
    # Its last activity was no later than the suspend, which last touched the row.
    return {"id": row.id, "name": row.name, "last_activity": jupyter_time(ws.updated_at),
            "execution_state": resting_state(ws), "connections": 0}


def _ask_running(platform: Platform, principal: Principal, workspace_id: str) -> bool:
    """Record the wish to run (a no-op when it is already the wish); True once it runs.

    A workspace being deleted has no kernels left to wake: 404."""
    with platform.db.transaction() as session:
        ws = workspaces.get_visible(session, principal, workspace_id, for_update=True)
        if DesiredState(ws.desired_state) is DesiredState.DELETED:
            raise NotFound(f"workspace {workspace_id} is being deleted")
        if ws.state == WorkspaceState.RUNNING and ws.desired_state == DesiredState.RUNNING:
            return True
        workspaces.request_state(ws, DesiredState.RUNNING, platform.db.now(session))
        return False


def _is_running(platform: Platform, principal: Principal,
                workspace_id: str) -> tuple[bool, tuple[str, str | None]]:
    """(whether it runs, (its state, its last placement error))."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        if DesiredState(ws.desired_state) is not DesiredState.RUNNING:
            raise Conflict(f"workspace was asked to be {ws.desired_state} while it resumed",
                           current_state=ws.state)
        return ws.state == WorkspaceState.RUNNING, (ws.state, ws.last_error)


async def wake(platform: Platform, principal: Principal, workspace_id: str,
               timeout: float = WAKE_TIMEOUT_S) -> None:
    """Resume the workspace if it is not running, and wait until it runs.

    Raises Conflict (naming the state, or the last placement error) when it does
    not come up in ``timeout`` seconds, or when someone suspends it meanwhile."""
    if await asyncio.to_thread(_ask_running, platform, principal, workspace_id):
        return
    platform.wake()
    running, (state, error) = await platform.until(
        workspace_id, lambda: _is_running(platform, principal, workspace_id), timeout)
    if not running:
        raise Conflict(f"workspace did not resume in {timeout:.0f} s: it is {state}"
                       + (f" ({error})" if error else ""), current_state=state)
