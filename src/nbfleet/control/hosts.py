"""The registry of agents (hosts): registration, heartbeats and liveness.

A host is alive while its last heartbeat, on the DB clock, is recent. When a host
comes back with a new boot id, or stops heartbeating, the runtimes it had are gone,
so its running workspaces go back to ``resuming`` for the reconciler to re-place.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from nbfleet.control import failover
from nbfleet.control.workspaces import transition
from nbfleet.db.engine import rows_affected
from nbfleet.db.tables import Agent, Workspace
from nbfleet.model.errors import Conflict, NotFound
from nbfleet.model.workspace import WorkspaceState
from nbfleet.policy.placement import HostLoad


def register(session: Session, now: datetime, body: dict[str, Any]) -> int:
    """Upsert an agent; returns how many workspaces now have work to do. A new
    boot ends a drain (``control/drain.py``): the host was stopped, and is back.

    A new host, or a host back with a new boot, also ends the backoff of workspaces
    waiting for a place to run: they should not sleep through the capacity arriving.
    """
    agent = session.get(Agent, body["id"], with_for_update=True)
    if agent is None:
        session.add(Agent(id=body["id"], url=body["url"], boot_id=body["boot_id"],
                          inventory=body["inventory"], registered_at=now, last_heartbeat_at=now))
        return _end_placement_backoff(session)
    agent.url = body["url"]
    agent.inventory = body["inventory"]
    agent.last_heartbeat_at = now
    if agent.boot_id == body["boot_id"]:
        return 0
    agent.boot_id = body["boot_id"]
    agent.registered_at = now
    # A drained host that starts again was stopped and upgraded: it takes work.
    agent.draining_since = None
    lost = runtimes_lost(session, agent.id, now, "host restarted", keep_boot=body["boot_id"])
    return lost + _end_placement_backoff(session)


def _end_placement_backoff(session: Session) -> int:
    result = session.execute(
        update(Workspace)
        .where(Workspace.pending.is_(True), Workspace.host_id.is_(None),
               Workspace.next_attempt_at.is_not(None))
        .values(next_attempt_at=None)
    )
    return rows_affected(result)


def heartbeat(session: Session, now: datetime, agent_id: str, boot_id: str) -> None:
    agent = session.get(Agent, agent_id, with_for_update=True)
    if agent is None:
        raise NotFound(f"unknown agent {agent_id}")
    if agent.boot_id != boot_id:
        raise Conflict("boot id changed: register again")
    agent.last_heartbeat_at = now


def kernel_died(session: Session, agent_id: str, workspace_id: str, reason: str) -> None:
    """Record why a kernel died as its workspace's last error; an agent may only
    speak for workspaces it runs, so a report about any other is ignored."""
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if ws is not None and ws.host_id == agent_id:
        ws.last_error = reason[:2000]


def runtimes_lost(session: Session, host_id: str, now: datetime, reason: str,
                  keep_boot: str | None = None) -> int:
    """Send the host's running workspaces back to ``resuming``."""
    query = select(Workspace).where(
        Workspace.host_id == host_id, Workspace.state == WorkspaceState.RUNNING
    ).with_for_update()
    lost = 0
    for ws in session.execute(query).scalars():
        if keep_boot is not None and ws.host_boot_id == keep_boot:
            continue
        transition(session, ws, WorkspaceState.RESUMING, now, reason)
        failover.mark_host_lost(ws, now, reason)
        ws.pending = True
        lost += 1
    return lost


def alive_since(now: datetime, timeout_s: float) -> datetime:
    return now - timedelta(seconds=timeout_s)


def alive_agent(session: Session, host_id: str | None, now: datetime,
                timeout_s: float) -> Agent | None:
    """The host if it heartbeats. A draining host still counts: a workspace whose
    runtime is already there keeps being served until the drain moves it; new
    placements never choose it, because :func:`host_loads` leaves it out."""
    if host_id is None:
        return None
    agent = session.get(Agent, host_id)
    if agent is None or agent.last_heartbeat_at < alive_since(now, timeout_s):
        return None
    return agent


def draining_hosts(session: Session) -> set[str]:
    """Hosts an admin (or the agent, on SIGTERM) is draining; few, so one query."""
    return set(session.execute(
        select(Agent.id).where(Agent.draining_since.is_not(None))).scalars())


def host_loads(session: Session, now: datetime, timeout_s: float) -> list[HostLoad]:
    """The hosts a new runtime may be placed on, with their loads: alive and not
    draining."""
    counts = dict(
        session.execute(
            select(Workspace.host_id, func.count())
            .where(Workspace.host_id.is_not(None))
            .group_by(Workspace.host_id)
        ).all()
    )
    agents = session.execute(
        select(Agent).where(Agent.last_heartbeat_at >= alive_since(now, timeout_s),
                            Agent.draining_since.is_(None))
    ).scalars()
    return [
        HostLoad(a.id, int(counts.get(a.id, 0)), int(a.inventory.get("millicpus", 1000)))
        for a in agents
    ]


def dead_hosts_with_runtimes(session: Session, now: datetime, timeout_s: float) -> list[str]:
    query = (
        select(Agent.id)
        .join(Workspace, Workspace.host_id == Agent.id)
        .where(Agent.last_heartbeat_at < alive_since(now, timeout_s),
               Workspace.state == WorkspaceState.RUNNING)
        .distinct()
    )
    return list(session.execute(query).scalars())
