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

from nbfleet.control import hosts
from nbfleet.control.fleet.moves import start_move
from nbfleet.control.workspaces import request_state
from nbfleet.db.tables import Agent, Kernel, Workspace
from nbfleet.model.errors import NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.policy.placement import least_loaded
from nbfleet.protocol.hosts import HostDrainState
from nbfleet.web.render import iso

if TYPE_CHECKING:
    from nbfleet.control.fleet.scheduler import LiveScheduler
    from nbfleet.control.platform import Platform


def empty_host(platform: Platform, host_id: str, scheduler: LiveScheduler | None) -> int:
    """Ask every workspace still on the host to leave; how many are still there.

    Idempotent: a workspace already on its way (suspending, moving, being deleted)
    is left alone, so calling this on every pass until it answers 0 is how a drain
    proceeds. A pass with nothing to send away only reads.
    """
    with platform.db.transaction(write=False) as session:
        total, leaving = _on_host(session, host_id, platform.db.now(session))
    if not leaving:
        return total
    with platform.db.transaction() as session:
        now = platform.db.now(session)
        # The agent's row before its workspaces', the order hosts.register takes.
        agent = session.get(Agent, host_id, with_for_update=True)
        rows = session.execute(_leaving(host_id, now).with_for_update()).scalars()
        for ws in rows:
            target = new_home(session, scheduler, ws.id, host_id, now,
                              platform.config.agent_timeout_s)
            if target is not None:
                start_move(session, ws, target, platform.db)
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


def new_home(session: Session, scheduler: LiveScheduler | None, workspace_id: str,
             leaving: str, now: datetime, timeout_s: float) -> str | None:
    """Where the policy now places the workspace's kernel (its evacuation moved the
    replica), else any other host the model has, else the least loaded host that
    takes placements (a CPU-only fleet); None if there is none."""
    if scheduler is not None:
        kernel = scheduler.policy.kernels.get(workspace_id)
        if kernel is not None:
            for host_id in kernel.hosts:
                if host_id != leaving:
                    return host_id
        others = sorted(h for h in scheduler.policy.hosts if h != leaving)
        if others:
            return others[0]
    loads = [load for load in hosts.host_loads(session, now, timeout_s)
             if load.host_id != leaving]
    return least_loaded(loads)


@dataclass(frozen=True)
class HostDrain:
    """A host's drain as the admin API reports it."""

    host_id: str
    draining: bool
    draining_since: datetime | None
    workspaces: int
    kernels: int
    moved: int
    suspended: int

    def state(self) -> HostDrainState:
        since = self.draining_since
        return HostDrainState(id=self.host_id, draining=self.draining,
                              draining_since=iso(since) if since is not None else None,
                              workspaces=self.workspaces, kernels=self.kernels,
                              moved=self.moved, suspended=self.suspended)


def start(session: Session, host_id: str, now: datetime) -> HostDrain:
    """Mark the host draining (again: a second drain keeps the first's start)."""
    agent = _agent(session, host_id)
    if agent.draining_since is None:
        agent.draining_since = now
        agent.drain_moved = agent.drain_suspended = 0
    return report(session, host_id)


def stop(session: Session, host_id: str) -> HostDrain:
    """The host takes new placements again; what already left stays where it went."""
    _agent(session, host_id).draining_since = None
    return report(session, host_id)


def report(session: Session, host_id: str) -> HostDrain:
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
    return HostDrain(host_id, agent.draining_since is not None, agent.draining_since,
                     int(workspaces), int(kernels), agent.drain_moved, agent.drain_suspended)


def _agent(session: Session, host_id: str) -> Agent:
    agent = session.get(Agent, host_id, with_for_update=True)
    if agent is None:
        raise NotFound(f"no host {host_id!r}")
    return agent
