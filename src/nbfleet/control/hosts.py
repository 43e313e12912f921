"""The registry of agents (hosts): registration, heartbeats and liveness.

A host is alive while its last heartbeat, on the DB clock, is recent. When a host
comes back with a new boot id, or stops heartbeating, the runtimes it had are gone,
so its running workspaces go back to ``resuming`` for the reconciler to re-place.
A heartbeat's reply names the runtimes the host still reports that are no longer
placed on it (:func:`stale_runtimes`): a host presumed dead that wakes up is told.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from nbfleet.control import failover
from nbfleet.control.workspaces import transition
from nbfleet.db.engine import rows_affected
from nbfleet.db.tables import Agent, Workspace
from nbfleet.model.errors import Conflict, NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState
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
    # What the old boot's runtimes had saved of their files, as it last said.
    files_as_of = _files_as_of(agent)
    agent.url = body["url"]
    agent.inventory = body["inventory"]
    agent.last_heartbeat_at = now
    if agent.boot_id == body["boot_id"]:
        return 0
    agent.boot_id = body["boot_id"]
    agent.registered_at = now
    # A drained host that starts again was stopped and upgraded: it takes work.
    agent.draining_since = None
    agent.disk_short = False  # until it says
    lost = runtimes_lost(session, agent.id, now, "host restarted", keep_boot=body["boot_id"],
                         files_as_of=files_as_of)
    return lost + _end_placement_backoff(session)


#: The states of a workspace being given a place to run (``model.workspace.plan``).
_PLACING = (WorkspaceState.CREATING, WorkspaceState.RESUMING, WorkspaceState.FAILED)


def _end_placement_backoff(session: Session) -> int:
    """Every workspace waiting to be placed is looked at again now, wherever its
    last runtime was: one whose host went away keeps that host's id (the same
    host, back with the same boot, still holds its runtime), and a long outage
    had grown its backoff to minutes. Its count of attempts starts again too: a
    first try that fails as the host settles must not wait minutes more. Only the
    pending rows (an index) are read."""
    result = session.execute(
        update(Workspace)
        .where(Workspace.pending.is_(True), Workspace.next_attempt_at.is_not(None),
               Workspace.desired_state == DesiredState.RUNNING,
               Workspace.state.in_([str(s) for s in _PLACING]))
        .values(next_attempt_at=None, attempts=0)
    )
    return rows_affected(result)


def heartbeat(session: Session, now: datetime, agent_id: str, boot_id: str,
              files_lag_s: float = 0.0, disk_short: bool | None = None) -> None:
    """Record the host alive. Its row is locked first: a presumption of its death
    (:func:`dead_hosts_with_runtimes`) is decided before this heartbeat or after
    it, never beside it, so :func:`stale_runtimes` in the same transaction sees it.
    ``files_lag_s``: how far behind the store its clean runtimes' files are;
    ``disk_short``: its disk is below the platform's reserve (None: not said)."""
    agent = session.get(Agent, agent_id, with_for_update=True)
    if agent is None:
        raise NotFound(f"unknown agent {agent_id}")
    if agent.boot_id != boot_id:
        raise Conflict("boot id changed: register again")
    agent.last_heartbeat_at = now
    agent.files_lag_s = files_lag_s
    if disk_short is not None:
        agent.disk_short = disk_short


def record_file_syncs(session: Session, agent_id: str, boot_id: str,
                      unsynced: Sequence[tuple[str, float | None]], now: datetime) -> None:
    """Keep, for each workspace this host runs, since when the store has lacked
    files its kernels wrote (``unsynced``: workspace id, seconds, or None for
    none). Only changes are written: an UPDATE that sets it where it was unset,
    or clears it where it was set, matches nothing on a heartbeat that changes
    nothing (one statement per workspace with unsynced files, one per chunk of
    the others)."""
    mine = (Workspace.host_id == agent_id, Workspace.host_boot_id == boot_id)
    clean = [workspace_id for workspace_id, seconds in unsynced if seconds is None]
    for start in range(0, len(clean), _CHUNK):
        session.execute(update(Workspace).where(
            Workspace.id.in_(clean[start:start + _CHUNK]), *mine,
            Workspace.files_unsynced_since.is_not(None)).values(files_unsynced_since=None))
    for workspace_id, seconds in unsynced:
        if seconds is not None:
            session.execute(update(Workspace).where(
                Workspace.id == workspace_id, *mine, Workspace.files_unsynced_since.is_(None)
            ).values(files_unsynced_since=now - timedelta(seconds=seconds)))


@dataclass(frozen=True)
class Placement:
    """Where the control plane runs a workspace, as far as fencing cares."""

    host_id: str | None
    host_boot_id: str | None
    #: The generation of the last placement that completed (None: none yet).
    placed_generation: int | None


def still_placed(placement: Placement | None, agent_id: str, boot_id: str,
                 generation: int) -> bool:
    """Whether an agent's runtime of ``generation`` is still the workspace's. A
    workspace gone, on another host or boot (placed elsewhere after this host was
    presumed dead, or suspended), or placed since with a newer generation, is not.
    A generation newer than the last completed placement's is one being placed."""
    if placement is None:
        return False
    if placement.host_id != agent_id or placement.host_boot_id != boot_id:
        return False
    return placement.placed_generation is None or generation >= placement.placed_generation


#: Workspace ids per query, well under any database's limit on bound parameters.
_CHUNK = 500


def stale_runtimes(session: Session, agent_id: str, boot_id: str,
                   held: Sequence[tuple[str, int]]) -> list[str]:
    """Of the runtimes an agent reports, (workspace id, generation), the workspaces
    no longer placed on it: it must drop them without writing their files back."""
    ids = list(dict.fromkeys(workspace_id for workspace_id, _ in held))
    placements: dict[str, Placement] = {}
    for start in range(0, len(ids), _CHUNK):
        rows = session.execute(
            select(Workspace.id, Workspace.host_id, Workspace.host_boot_id,
                   Workspace.placed_generation)
            .where(Workspace.id.in_(ids[start:start + _CHUNK])))
        placements.update((row[0], Placement(*row[1:])) for row in rows)
    return [workspace_id for workspace_id, generation in held
            if not still_placed(placements.get(workspace_id), agent_id, boot_id, generation)]


def kernel_died(session: Session, agent_id: str, workspace_id: str, reason: str) -> None:
    """Record why a kernel died as its workspace's last error; an agent may only
    speak for workspaces it runs, so a report about any other is ignored."""
    ws = session.get(Workspace, workspace_id, with_for_update=True)
    if ws is not None and ws.host_id == agent_id:
        ws.last_error = reason[:2000]


def _files_as_of(agent: Agent) -> datetime:
    """Until when the store held every file of the host's runtimes that reported
    none unsynced: its last heartbeat, less the lag it reported then."""
    return agent.last_heartbeat_at - timedelta(seconds=agent.files_lag_s)


def runtimes_lost(session: Session, host_id: str, now: datetime, reason: str,
                  keep_boot: str | None = None, files_as_of: datetime | None = None) -> int:
    """Send the host's running workspaces back to ``resuming``. ``files_as_of``:
    until when the store held every file of the runtimes that reported none
    unsynced (default: the host's last heartbeat, less the lag it reported)."""
    if files_as_of is None:
        agent = session.get(Agent, host_id)
        if agent is not None:
            files_as_of = _files_as_of(agent)
    query = select(Workspace).where(
        Workspace.host_id == host_id, Workspace.state == WorkspaceState.RUNNING
    ).with_for_update()
    lost = 0
    for ws in session.execute(query).scalars():
        if keep_boot is not None and ws.host_boot_id == keep_boot:
            continue
        transition(session, ws, WorkspaceState.RESUMING, now, reason)
        failover.mark_host_lost(ws, now, reason, ws.files_unsynced_since or files_as_of)
        ws.files_unsynced_since = None  # its next placement starts from the store
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
    """The hosts a new runtime may be placed on, with their loads: alive, not
    draining, and not short of disk."""
    counts = dict(
        session.execute(
            select(Workspace.host_id, func.count())
            .where(Workspace.host_id.is_not(None))
            .group_by(Workspace.host_id)
        ).all()
    )
    agents = session.execute(
        select(Agent).where(Agent.last_heartbeat_at >= alive_since(now, timeout_s),
                            Agent.draining_since.is_(None), Agent.disk_short.is_(False))
    ).scalars()
    return [
        HostLoad(a.id, int(counts.get(a.id, 0)), int(a.inventory.get("millicpus", 1000)))
        for a in agents
    ]


def dead_hosts_with_runtimes(session: Session, now: datetime, timeout_s: float) -> list[str]:
    """Hosts silent for ``timeout_s`` that still have running workspaces. Their rows
    are locked, as :func:`heartbeat` locks its own: a heartbeat committed meanwhile
    takes its host off the list (PostgreSQL checks the row again once it may lock
    it), and one waiting behind the lock sees the workspaces marked lost."""
    running = select(Workspace.host_id).where(Workspace.state == WorkspaceState.RUNNING)
    query = (
        select(Agent.id)
        .where(Agent.last_heartbeat_at < alive_since(now, timeout_s), Agent.id.in_(running))
        .order_by(Agent.id)
        .with_for_update()
    )
    return list(session.execute(query).scalars())
