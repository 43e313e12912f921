"""A live runtime's working directory mirrors the blob store: what an API write
changes in the store is copied into the runtime, if the workspace runs now."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from nbfleet.control import hosts, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.platform import Platform
from nbfleet.model.errors import Conflict, DomainError
from nbfleet.model.workspace import WorkspaceState
from nbfleet.storage.contents import Change

log = logging.getLogger(__name__)

_GONE = (WorkspaceState.DELETING, WorkspaceState.DELETED)


def live_host(platform: Platform, principal: Principal, workspace_id: str,
              writing: bool) -> str | None:
    """Check access (404 for another tenant's); the URL of the host running the
    workspace, if any. Writing to a workspace being deleted is a conflict."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        if writing and ws.state in _GONE:
            raise Conflict(f"workspace is {ws.state}", current_state=ws.state)
        if ws.state != WorkspaceState.RUNNING:
            return None
        now = platform.db.now(session)
        agent = hosts.alive_agent(session, ws.host_id, now, platform.config.agent_timeout_s)
        return agent.url if agent is not None and agent.boot_id == ws.host_boot_id else None


async def mirror(platform: Platform, host: str | None, workspace_id: str,
                 changes: Iterable[Change]) -> None:
    """Copy saved changes into the live runtime. They are saved already: a runtime
    that misses one catches up when it is next placed."""
    if host is None:
        return
    for change in changes:
        try:
            if change.data is None:
                await platform.agents.delete_file(host, workspace_id, change.path)
            else:
                await platform.agents.put_file(host, workspace_id, change.path, change.data)
        except DomainError as exc:
            log.warning("could not mirror %s into the runtime: %s", change.path, exc.detail)
