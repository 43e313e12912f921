"""Emptying a host: one path for the autoscaler's scale-in and an admin's drain.

Every running workspace on the host is moved with its state to another host (a
suspend to the blob store and a resume there, keeping its kernel ids: see
``fleet/moves.py``), or suspended when there is no other host. A host an admin
drains is marked in the DB (``agents.draining_since``), so that placements skip it
(``hosts.host_loads``), the fleet scheduler drops it from its model like a host the
autoscaler is releasing, and a control-plane restart keeps draining it; the
lease-holder's fleet pass calls :func:`empty_host` for it until it is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from nbfleet.control import hosts, leases
from nbfleet.control.fleet.moves import start_move
from nbfleet.control.workspaces import request_state
from nbfleet.db.engine import Database
from nbfleet.db.tables import Agent, Kernel, Workspace
from nbfleet.model.errors import NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.policy.placement import least_loaded
from nbfleet.protocol.hosts import HostDrainState
from nbfleet.web.render import iso

if TYPE_CHECKING:
    from nbfleet.control.fleet.scheduler import LiveScheduler


@dataclass(frozen=True)
class Homes:
    """Where the policy's model sends a leaving host's workspaces. Read on the event
    loop, where the scheduler lives (its dictionaries change there), and handed to
    :func:`empty_host`, which runs in a worker thread."""

    #: Workspace → the first of its kernel's replica hosts that is not the leaving one
    #: (the policy moved the replica off it when the host left the model).
    by_workspace: dict[str, str]
    #: Any other host the model has (the lowest id), for a workspace it has no replica of.
    any_other: str | None

    @classmethod
    def of(cls, scheduler: LiveScheduler | None, leaving: str) -> Homes:
        if scheduler is None:
            return cls({}, None)
        homes = {}
        for workspace_id, kernel in scheduler.policy.kernels.items():
            home = next((h for h in kernel.hosts if h != leaving), None)
            if home is not None:
                homes[workspace_id] = home
        return cls(homes, min((h for h in scheduler.policy.hosts if h != leaving),
                              default=None))


def empty_host(db: Database, host_id: str, homes: Homes, token: int, timeout_s: float) -> int:
    """Ask every workspace still on the host to leave; how many are still there.

    Idempotent: a workspace already on its way (suspending, moving, being deleted)
    is left alone, so calling this on every pass until it answers 0 is how a drain
    proceeds. A pass with nothing to send away only reads. ``token``: the fencing
    token of the reconciler's lease, checked where the moves are written (a replica
    that lost it since sends nothing away); ``timeout_s``: the agents' (which hosts
    are alive to take a workspace the policy has no home for).
    """
    with db.transaction(write=False) as session:
        total, leaving = _on_host(session, host_id, db.now(session))
    if not leaving:
        return total
    with db.transaction() as session:
        if not leases.still_held(session, leases.WORKSPACES, token):
            return total
        now = db.now(session)
        # The agent's row before its workspaces', the order hosts.register takes.
        agent = session.get(Agent, host_id, with_for_update=True)
        rows = session.execute(_leaving(host_id, now).with_for_update()).scalars()
        for ws in rows:
            target = new_home(session, homes, ws.id, host_id, now,
                              timeout_s)
            if target is not None:
                start_move(session, ws, target, db)
            else:
                request_state(ws, DesiredState.SUSPENDED, now)
            if agent is not None:
                if target is not None:
                    agent.drain_moved += 1
                else:
                    agent.drain_suspended += 1
        return _on_host(session, host_id, now)[0]


#: States in which a workspace may have a runtime on its host. A FAILED placement
#: keeps its host recorded, but nothing runs there: it must not hold a drain open.
_WITH_RUNTIME = (WorkspaceState.CREATING, WorkspaceState.RUNNING, WorkspaceState.SUSPENDING,
                 WorkspaceState.RESUMING, WorkspaceState.DELETING)


def _leaving(host_id: str, now: datetime) -> Select[Workspace]:
    """The host's workspaces a drain must still send away: running, and meant to
    keep running (a move in progress is SUSPENDING or RESUMING, not RUNNING), and
    not waiting out the backoff of a move that could not suspend."""
    return select(Workspace).where(
        Workspace.host_id == host_id, Workspace.state == WorkspaceState.RUNNING,
        Workspace.desired_state == DesiredState.RUNNING,
        Workspace.next_attempt_at.is_(None) | (Workspace.next_attempt_at <= now))


def _on_host(session: Session, host_id: str, now: datetime) -> tuple[int, int]:
    """(workspaces whose runtime is on the host, those of them still to send away)."""
    total = session.execute(select(func.count()).select_from(Workspace)
                            .where(Workspace.host_id == host_id,
                                   Workspace.state.in_(_WITH_RUNTIME))).scalar_one()
    leaving = session.execute(select(func.count())
                              .select_from(_leaving(host_id, now).subquery())).scalar_one()
    return int(total), int(leaving)


def new_home(session: Session, homes: Homes, workspace_id: str,
             leaving: str, now: datetime, timeout_s: float) -> str | None:
    """Where the policy now places the workspace's kernel (its evacuation moved the
    replica), else any other host the model has, else the least loaded host that
    takes placements (a CPU-only fleet); None if there is none."""
    home = homes.by_workspace.get(workspace_id) or homes.any_other
    if home is not None:
        return home
    loads = [load for load in hosts.host_loads(session, now, timeout_s)
             if load.host_id != leaving]
    return least_loaded(loads)


def start(session: Session, host_id: str, now: datetime) -> HostDrainState:
    """Mark the host draining (again: a second drain keeps the first's start)."""
    agent = _agent(session, host_id)
    if agent.draining_since is None:
        agent.draining_since = now
        agent.drain_moved = agent.drain_suspended = 0
    return report(session, host_id)


def stop(session: Session, host_id: str) -> HostDrainState:
    """The host takes new placements again; what already left stays where it went."""
    _agent(session, host_id).draining_since = None
    return report(session, host_id)


def report(session: Session, host_id: str) -> HostDrainState:
    """A host's drain as the admin API reports it."""
    agent = session.get(Agent, host_id)
    if agent is None:
        raise NotFound(f"no host {host_id!r}")
    workspaces = session.execute(
        select(func.count()).select_from(Workspace)
        .where(Workspace.host_id == host_id,
               Workspace.state.in_(_WITH_RUNTIME))).scalar_one()
    kernels = session.execute(
        select(func.count()).select_from(Kernel)
        .join(Workspace, Kernel.workspace_id == Workspace.id)
        .where(Workspace.host_id == host_id,
               Workspace.state.in_(_WITH_RUNTIME))).scalar_one()
    since = agent.draining_since
    return HostDrainState(id=host_id, draining=since is not None,
                          draining_since=iso(since) if since is not None else None,
                          workspaces=int(workspaces), kernels=int(kernels),
                          moved=agent.drain_moved, suspended=agent.drain_suspended)


def _agent(session: Session, host_id: str) -> Agent:
    agent = session.get(Agent, host_id, with_for_update=True)
    if agent is None:
        raise NotFound(f"no host {host_id!r}")
    return agent
