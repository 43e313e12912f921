"""Moving a running kernel to the host where the scheduler bound its cell's GPUs.

Until standby replicas run hot (NotebookOS keeps three live replicas), a policy
decision to run a cell on another host is carried out with the mechanism that
suspend and resume already trust: the kernel's state and files are saved to the
blob store, the runtime is released, and it is placed again on the target host
with the same kernel ids. To the reconciler a move is a suspend whose desired
state stays ``running`` plus a recorded target (``workspaces.move_to``).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from nbfleet.control.workspaces import transition
from nbfleet.db.engine import Database
from nbfleet.db.tables import Workspace
from nbfleet.model.workspace import DesiredState, WorkspaceState


def request_move(db: Database, workspace_id: str, host_id: str) -> bool:
    """Ask the reconciler to move the workspace's runtime to ``host_id``; False if
    the workspace is not running steadily (it is being suspended, deleted, moved)."""
    with db.transaction() as session:
        ws = session.get(Workspace, workspace_id, with_for_update=True)
        if ws is None or ws.desired_state != DesiredState.RUNNING:
            return False
        if ws.state == WorkspaceState.RUNNING and ws.host_id == host_id:
            return True
        if ws.state != WorkspaceState.RUNNING or ws.move_to is not None:
            return False
        start_move(session, ws, host_id, db)
        return True


def start_move(session: Session, ws: Workspace, host_id: str, db: Database) -> None:
    now = db.now(session)
    ws.move_to = host_id
    ws.generation += 1
    ws.attempts = 0
    ws.next_attempt_at = None
    transition(session, ws, WorkspaceState.SUSPENDING,
               now, f"moving to host {host_id}, where its cell's GPUs are")
