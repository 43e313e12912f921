"""Rows a unit test needs in a migrated database: a workspace with its owner, and
its kernel."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from nbfleet.db.engine import Database
from nbfleet.db.tables import Kernel, Org, Project, User, Workspace


def add_workspace(db: Database, workspace_id: str, kernel_id: str, tag: str,
                  **fields: Any) -> None:
    """The workspace (``fields`` set its state, generation, snapshot...) in an org,
    project and user named after ``tag``, with one ``python3`` kernel."""
    now = datetime.now(UTC)
    org, project, user = f"org_{tag}", f"prj_{tag}", f"usr_{tag}"
    with db.transaction() as session:
        session.add(Org(id=org, name=org, created_at=now))
        session.add(Project(id=project, org_id=org, name="p", created_at=now))
        session.add(User(id=user, org_id=org, project_id=project, name="u", created_at=now))
        session.flush()
        session.add(Workspace(id=workspace_id, org_id=org, project_id=project, owner_id=user,
                              name="w", created_at=now, updated_at=now, **fields))
        session.flush()
        session.add(Kernel(id=kernel_id, workspace_id=workspace_id, name="python3",
                           created_at=now))
